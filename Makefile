# The README's commands: `make demo`, `make test` and its fast tier `make unit` (each installs what it needs first).
PYTHON ?= /usr/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
HOOK := $(VENV)/bin/oci-gpu-hook
DEMO_DIR ?= /tmp/oci-gpu-hook-demo

.PHONY: setup demo test lint unit clean rpm bench stubs image

setup: $(VENV)/.installed

# The whole suite's packages and Python dependencies (`make test`, `make bench`, `make lint`); the
# image's at the versions it locks, so that the suite's builds of the image (tests/deploy,
# tests/e2e/test_deploy.py) are `make image`'s.
$(VENV)/.installed: pyproject.toml scripts/setup-host.sh deploy/image-requirements.txt
	./scripts/setup-host.sh test
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c deploy/image-requirements.txt -e '.[test]'
	touch $@

# The demo's only: no test tools, no container daemons (docker.io, containerd and prometheus
# would be enabled and started on a systemd host).
$(VENV)/.installed-demo: pyproject.toml scripts/setup-host.sh
	./scripts/setup-host.sh demo
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

demo: $(VENV)/.installed-demo
	@echo "=== a real runc container with NVIDIA_VISIBLE_DEVICES=1 on a simulated 4-GPU host"
	$(HOOK) demo --dir $(DEMO_DIR) --devices 1
	@echo "=== the simulated host itself: nvidia-smi -L and oci-gpu-hook info"
	LD_LIBRARY_PATH=$(DEMO_DIR)/host/usr/lib64 $(DEMO_DIR)/host/usr/bin/nvidia-smi -L
	$(HOOK) --config $(DEMO_DIR)/host/config.yaml info | head -24

lint: setup
	$(VENV)/bin/ruff check oci_gpu_hook tests bench deploy
	$(VENV)/bin/ruff format --check oci_gpu_hook tests bench deploy
	$(VENV)/bin/vermin --target=3.9- --violations --eval-annotations --no-tips oci_gpu_hook tests

# The shared tools the end-to-end suites run are built in the background from the start (a cold
# machine needs about 12 minutes for them), while lint and the other suites run; pytest runs the
# end-to-end suites last (tests/conftest.py), and waits on a tool still being built. The node VM
# boots in the background too, once lint passed, each policy flavour in turn, and stops if make
# does (tests/vmcheck.py): tests/e2e/test_node_vm.py reads its runs from build/node-vm.json (debian)
# and build/node-vm-rhel.json (VMCHECK_BOOTED).
test: setup
	mkdir -p build
	nice -n 10 $(PY) tests/toolbuild.py > build/tools.log 2>&1 &
	$(MAKE) lint
	rm -f build/node-vm*.json build/node-vm*.json.lock
	$(PY) tests/vmcheck.py --for-pid $$PPID build/node-vm.json > build/node-vm.log 2>&1 &
	VMCHECK_BOOTED=$(CURDIR)/build/node-vm.json $(VENV)/bin/pytest -q tests
	cat build/tools.log build/node-vm.log

# The fast tier (docs/testing.md): every suite but the end-to-end ones (tests/e2e: real runtimes
# and daemons, a kubelet, a cluster, the node VM), which take most of `make test`'s time.
unit: setup
	$(VENV)/bin/pytest -q tests --ignore=tests/e2e

# The kubelet device plugin API's Python modules, from oci_gpu_hook/node/kubelet_api/deviceplugin.proto.
stubs:
	./scripts/generate-kubelet-stubs.sh

# `make bench SOAK_STARTS=2000`: a shorter soak of the start server (bench/soak.py; 10,000 served starts
# take about 12 minutes on 2 cores, at a 2,000-start run's rate).
SOAK_STARTS ?= 10000

bench: setup
	$(PY) bench/run.py --runs 30
	$(PY) bench/cdi.py --cdi-runs 10
	$(PY) bench/soak.py --starts $(SOAK_STARTS)
	$(PY) bench/exporter_fields.py
	$(PY) bench/sandbox_mounts.py
	$(PY) bench/cluster.py

# `make rpm`: the oci-gpu-hook (per architecture: the compiled pre-filter) and oci-gpu-hook-selinux
# (noarch) RPMs from the working tree, with rpmbuild (Debian's works; see rpm/oci-gpu-hook.spec),
# left in $(RPM_TOPDIR)/RPMS/<arch>/. SELINUX_HEADERS=DIR builds the module against another policy's
# headers than this host's selinux-policy-devel (the spec's selinux_headers).
RPM_SPEC := rpm/oci-gpu-hook.spec
RPM_VERSION := $(shell awk '/^Version:/ {print $$2; exit}' $(RPM_SPEC))
RPM_TOPDIR ?= $(CURDIR)/build/rpm
RPM_SOURCES := README.md pyproject.toml oci_gpu_hook selinux rpm hooks.d docs

# `make image`: the node services' image (deploy/build-image.py), built offline from this machine's
# python3 and libraries and the locked Python packages (deploy/image-requirements.txt), as a
# docker-archive in build/, the same bytes every time (docs/deploy.md, "The node services"). It
# installs what the build needs and nothing of the test suite's. The SELinux module the toolkit
# loads is compiled for this host's policy family and, with SELINUX_HEADERS=DIR, for that one
# (RHEL's headers on a Debian build host: ../shared/tools/selinux-rhel).
$(VENV)/.installed-image: scripts/setup-host.sh deploy/image-requirements.txt
	./scripts/setup-host.sh image
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r deploy/image-requirements.txt
	touch $@

image: $(VENV)/.installed-image
	$(PY) deploy/build-image.py --output build/oci-gpu-hook-node.tar \
		$(if $(SELINUX_HEADERS),--selinux-headers $(SELINUX_HEADERS))

rpm:
	./scripts/setup-host.sh
	rm -rf $(RPM_TOPDIR)
	mkdir -p $(RPM_TOPDIR)/SOURCES
	tar -czf $(RPM_TOPDIR)/SOURCES/oci-gpu-hook-$(RPM_VERSION).tar.gz --sort=name --owner=0 --group=0 \
		--exclude=__pycache__ --exclude='*.pyc' --exclude=tmp --exclude='*.pp' --exclude='*.pp.bz2' \
		--transform 's,^,oci-gpu-hook-$(RPM_VERSION)/,S' $(RPM_SOURCES)
	rpmbuild -bb --nodeps --quiet --define "_topdir $(RPM_TOPDIR)" \
		$(if $(SELINUX_HEADERS),--define "selinux_headers $(SELINUX_HEADERS)") $(RPM_SPEC)
	@ls -1 $(RPM_TOPDIR)/RPMS/*/*.rpm

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
