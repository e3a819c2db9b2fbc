# Device call 1 of the proof session: wheels into /tmp/site, first half of the SmolLM2 GGUF to /tmp.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
cp .gg1/p1 /tmp/gguf.p1
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())"
