# The README's two commands: `make demo` and `make test` (both install what they need first).
PYTHON ?= /usr/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
HOOK := $(VENV)/bin/oci-gpu-hook
DEMO_DIR ?= /tmp/oci-gpu-hook-demo

.PHONY: setup demo test lint unit clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup-host.sh
	./scripts/setup-host.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: setup
	@echo "=== a real runc container with NVIDIA_VISIBLE_DEVICES=1 on a simulated 4-GPU host"
	$(HOOK) demo --dir $(DEMO_DIR) --devices 1
	@echo "=== the simulated host itself: nvidia-smi -L and oci-gpu-hook info"
	LD_LIBRARY_PATH=$(DEMO_DIR)/host/usr/lib64 $(DEMO_DIR)/host/usr/bin/nvidia-smi -L
	$(HOOK) --config $(DEMO_DIR)/host/config.yaml info --no-nvml | head -20

lint: setup
	$(VENV)/bin/ruff check oci_gpu_hook tests
	$(VENV)/bin/vermin --target=3.9- --violations --eval-annotations --no-tips oci_gpu_hook tests

test: setup lint
	$(VENV)/bin/pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
