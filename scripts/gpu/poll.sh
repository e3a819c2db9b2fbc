# Device calls 3+: wait for the running proof.py, collect results and the named exports.
# SNAPSHOT (the last call of a lease): runs that have not finished send the export of their latest checkpoint.
export PYTHONPATH=/tmp/site EAGLE3_CACHE=/tmp/cache
cd /tmp/w && python3 scripts/gpu/collect.py --work /tmp/proof --out $OUT --wait ${WAIT:-500} ${EXPORTS:+--exports $EXPORTS} \
    ${SNAPSHOT:+--snapshot $SNAPSHOT}
tail -30 /tmp/proof/runner.log
grep -h "tok_s\|regenerate\]" /tmp/proof/logs/*.log | tail -5
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv
