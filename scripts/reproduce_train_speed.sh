#!/usr/bin/env bash
# The training-step table of docs/perf.md: our step against SpecForge 0.2.0's at the Kimi-size
# drafter's dimensions, 2048 and 4096 tokens, on one GPU, one after the other in one run (the ratio
# is the figure that holds across machines; absolute tokens/s differ by a few % between GPUs).
#
#   bash scripts/reproduce_train_speed.sh SPECFORGE_DIR [OUT_DIR]
#   GPU=1 PIECES="numerics_2048 profile_4096" bash scripts/reproduce_train_speed.sh SPECFORGE_DIR
#
# SPECFORGE_DIR: a directory that holds SpecForge's `specforge` package, e.g. a checkout of its
# repository at v0.2.0, or `pip install --no-deps --target DIR specforge==0.2.0` (pure Python).
# PIECES picks what runs, in order (default: the four columns of the table):
#   ours_N / sf_N   our step / SpecForge's at N tokens
#   numerics_N      our bf16 step, eager and compiled, against fp32 eager (loss, gradients, optimizer)
#   profile_N       where one step's time goes (kernels by op and shape)
#   lengths_N       what a sequence length not seen before costs (cuDNN plans, recompiles)
# Each piece writes OUT_DIR/<piece>.log; the lines the table quotes are printed.
set -u
SF=${1:?usage: bash scripts/reproduce_train_speed.sh SPECFORGE_DIR [OUT_DIR]}
OUT=${2:-train_speed_logs}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=${GPU:-0}
PY=${PYTHON:-python}
K="--preset kimi --device cuda --dtype bf16 --compile on"
run() {
  name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "ms/step|tok/s|tokens/s|peak|forward|backward|optim|MFU|busy|numerics|new lengths" "$OUT/$name.log" | head -20
}
for piece in ${PIECES:-ours_2048 sf_2048 ours_4096 sf_4096}; do
  seq=${piece##*_}
  case $piece in
    ours_*) run "$piece" $PY bench/train_speed.py $K --seq "$seq" ;;
    sf_*) run "$piece" env PYTHONPATH="$SF${PYTHONPATH:+:$PYTHONPATH}" $PY bench/specforge_step.py --preset kimi --seq "$seq" ;;
    numerics_*) run "$piece" $PY bench/train_speed.py --preset kimi --device cuda --dtype bf16 --seq "$seq" --check-numerics ;;
    profile_*) run "$piece" $PY bench/train_speed.py $K --seq "$seq" --profile --shapes --stacks ;;
    lengths_*) run "$piece" $PY bench/train_speed.py $K --seq "$seq" --new-lengths 8 ;;
    *) echo "unknown piece $piece"; exit 2 ;;
  esac
done
