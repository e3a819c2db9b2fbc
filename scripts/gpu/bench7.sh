# Issue 7's benchmark in device calls (carry [".whl", ".old"]): ours (this tree) against the code
# before this session's changes (.old/old.tar, from `git archive <commit> eagle3 bench`) and
# SpecForge 0.2.0, on the same GPU. Each piece writes $OUT/<name>.log; PIECES picks them, in
# order (default: the speed comparison); GPU: which GPU of the machine (another may be training).
#   PIECES="numerics_2048 profile_2048 old_4096"   the numerics check, where the time goes, more
#   PIECES="softce_ours softce_old"                 the heads' soft cross-entropy alone (bench/soft_ce_speed.py)
#   PIECES="lengths_4096 attn_4096"                 what a sequence length not seen before costs
set -u
export CUDA_VISIBLE_DEVICES=${GPU:-0}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/old && tar xf .old/old.tar -C /tmp/old
export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
K="--preset kimi --device cuda --dtype bf16 --compile on"
run() { name=$1; shift; echo "== $name: $*"; timeout ${LIMIT:-200} "$@" > $OUT/$name.log 2>&1; echo "rc $?"; grep -E "ms/step|tok/s|tokens/s|peak|forward|backward|optim|MFU|busy|numerics|new lengths| ms .*x  " $OUT/$name.log | head -20; }
for piece in ${PIECES:-ours_2048 sf_2048 old_2048 ours_4096 sf_4096}; do
  seq=${piece##*_}
  case $piece in
    ours_*) run $piece python3 bench/train_speed.py $K --seq $seq ;;
    sf_*) run $piece python3 bench/specforge_step.py --preset kimi --seq $seq ;;
    old_*) run $piece env PYTHONPATH=/tmp/old:/tmp/site python3 /tmp/old/bench/train_speed.py $K --seq $seq ;;
    numerics_*) run $piece python3 bench/train_speed.py --preset kimi --device cuda --dtype bf16 --seq $seq --check-numerics ;;
    lengths_*) run $piece python3 bench/train_speed.py $K --seq $seq --new-lengths 8 ;;
    attn_*) run $piece python3 bench/attention_speed.py --seq $seq --new-lengths 8 ;;
    softce_ours) run $piece python3 bench/soft_ce_speed.py ;;
    softce_old) run $piece env PYTHONPATH=/tmp/old:/tmp/site python3 bench/soft_ce_speed.py ;;
    profile_*) run $piece python3 bench/train_speed.py $K --seq $seq --profile --shapes --stacks ;;
  esac
done
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv
