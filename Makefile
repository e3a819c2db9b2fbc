# The two quickstart commands (README): `make train` and `make test`. Both set up first (idempotent).
.PHONY: setup train test test-fast

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/python train.py

# Main suite in .venv (vLLM CPU engine included; the 15 slowest tests listed at the end), two test
# files at a time (pytest-xdist; a file's tests stay together and share its fixtures), then the
# SGLang suite in its own environment.
test: setup
	.venv/bin/python -m pytest tests -q -p no:cacheprovider --ignore=tests/sglang --durations=15 -n 2 --dist loadfile
	.venv-sglang/bin/python -m pytest tests/sglang -q -p no:cacheprovider

test-fast: setup
	.venv/bin/python -m pytest tests -q -m "not slow" --ignore=tests/sglang
