# Issue 7's benchmark in one device call (carry [".whl", ".old"]): ours (this tree) against the
# code before this session's changes (.old/old.tar, from `git archive <commit> eagle3 bench`) and
# SpecForge 0.2.0, all on the same GPU in one run; then ours at 4096 and the numerics check.
# Each piece writes $OUT/<name>.log; the most important ones run first, in case the call is cut.
# PROFILE=1: also where the time of one step goes, by op and input shape (last).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/old && tar xf .old/old.tar -C /tmp/old
export PYTHONPATH=/tmp/site
K="--preset kimi --device cuda --dtype bf16 --compile on"
run() { name=$1; shift; echo "== $name: $*"; timeout ${LIMIT:-200} "$@" > $OUT/$name.log 2>&1; echo "rc $?"; grep -E "ms/step|tok/s|tokens/s|peak|forward|optim|MFU" $OUT/$name.log | head -12; }
run ours_2048 python3 bench/train_speed.py $K --seq 2048
run sf_2048 env PYTHONPATH=/tmp/site python3 bench/specforge_step.py --preset kimi --seq 2048
run ours_4096 python3 bench/train_speed.py $K --seq 4096
run sf_4096 env PYTHONPATH=/tmp/site python3 bench/specforge_step.py --preset kimi --seq 4096
run old_2048 env PYTHONPATH=/tmp/old:/tmp/site python3 /tmp/old/bench/train_speed.py $K --seq 2048
run numerics_2048 python3 bench/train_speed.py --preset kimi --device cuda --dtype bf16 --seq 2048 --check-numerics
run old_4096 env PYTHONPATH=/tmp/old:/tmp/site python3 /tmp/old/bench/train_speed.py $K --seq 4096
[ -n "${PROFILE:-}" ] && run profile_2048 python3 bench/train_speed.py $K --seq 2048 --profile --shapes
nvidia-smi --query-gpu=name,memory.used --format=csv
