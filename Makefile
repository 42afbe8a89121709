# chv.fleet: the two entry points are `make demo` and `make test` (README).
# Everything they need is installed from here: apt packages, a project venv
# per Python leg with the locked toolchain, the collection installed into a
# collections path of its own.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

ROOT := $(CURDIR)
PY311 ?= python3
# The first python3.12 that really runs (a pyenv shim without that version active does not).
PY312 ?= $(shell for p in $$(ls /root/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null) $$(command -v python3.12); do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV := $(ROOT)/.venv
VENV312 := $(ROOT)/.venv312
# Playwright for chv-browser's unit tests, on Debian's python3 as in the
# service's venv (the service runs as an unprivileged user, which cannot use
# pyenv's interpreters under /root), driving Debian's chromium.
BROWSER_VENV := $(ROOT)/build/browser-venv
BUILD := $(ROOT)/build
# Development collections path: ansible_collections/chv/fleet -> this checkout,
# ansible_collections/chv/fleet_lab -> lab/ (the test lab: an internal
# collection that Molecule, make demo and the tests use; never released).
DEVCOLL := $(BUILD)/dev-collections
export ANSIBLE_COLLECTIONS_PATH := $(DEVCOLL)
export ANSIBLE_ROLES_PATH := $(ROOT)/roles
export ANSIBLE_FORCE_COLOR := 0
export PY_COLORS := 0
export ANSIBLE_NOCOLOR := 1

# sudo: the executor's path (tests/integration/cells runs chv-cell as a plain user through it).
# The packages cells need (the launcher's own, tests/integration/cells runs it
# here) have one home, the cell_runtime role's list: read from there.
CELL_PACKAGES := $(shell sed -n '/^__cell_runtime_packages:/,/^$$/s/^  - \([a-z0-9.+-]*\).*/\1/p' $(ROOT)/roles/cell_runtime/vars/Debian.yml)
# lighttpd, git: the authenticated git server (git http-backend) of tests/integration/cells' tasks;
# squid, dnsmasq-base: the egress proxy and the resolver stand-in of tests/integration/netns.
SYS_PACKAGES := $(CELL_PACKAGES) mmdebstrap nftables zstd openssh-client tar python3-venv sudo squid dnsmasq-base \
                chromium fonts-dejavu-core libatomic1 lighttpd git
DEMO_LAB ?= demo
DEMO_INVENTORY = /var/lib/chv-fleet-lab/$(DEMO_LAB)/inventory.yml
# the suites under tests/integration (one make target each: integration-<suite>)
INTEGRATION := cells netns broker browser playbooks
# make test: four lanes at once, each a chain run in order (-j1 inside a
# lane). The trixie scenario (the install path) waits on the Debian mirror
# and the lab tests on guests booting more than on the CPU: each has a lane
# of its own, so that their waits overlap the other lanes' work. The run is
# bound by the CPU work of all lanes together (docs/performance.md). Each
# lane's lines carry its name (and go to build/lanes/<lane>.log); a failing
# stage stops its lane, and make reports the failure once every lane has
# ended, after one summary line per lane (tests passed, failed, skipped, and
# every skip's reason: hack/lane_summary.py). The lanes touch
# nothing in common: the host lane uses this machine's own namespaces (veths
# lth*, netns cnt-*), each lab its own network, table and guests; the image
# and wheel caches are shared under locks. The lab lane, the shortest since
# its proxy-mode guest went (issue 36), runs the integration playbooks after
# its own tests: they end with the others' instead of the host lane's tail.
LANE_host := lint sanity units release-check docs $(filter-out integration-playbooks,$(INTEGRATION:%=integration-%)) \
             test-leg312
LANE_guests1 := molecule-fleet
LANE_guests2 := molecule-trixie
LANE_lab := lab-tests integration-playbooks
LANES := host guests1 guests2 lab
SCENARIOS ?= $(sort $(notdir $(patsubst %/molecule.yml,%,$(wildcard molecule/*/molecule.yml))))

.PHONY: fuzz help sysdeps venv venv312 browser-venv devcoll lint sanity units integration $(INTEGRATION:%=integration-%) \
        lab-tests molecule $(SCENARIOS:%=molecule-%) test test-leg312 $(LANES:%=lane-%) \
        demo lab-down build release-check docs bench lock clean image test-vm

help:
	@echo "make demo      bring up a lab guest, converge site.yml on it, print a summary"
	@echo "make test      lint, sanity, unit, integration, lab and Molecule tests (both Python legs), in four lanes"
	@echo "make lab-down  destroy the demo lab"
	@echo "make docs      the docs site (antsibull-docs): build/docs/html/index.html"
	@echo "make bench     benchmarks (not tests)"
	@echo "make fuzz      the long fuzz run of the request parsers and the policy validator (102,000 inputs)"
	@echo "make image     bake the CHV guest image (qcow2, kernel, initrd) into build/image (docs/chv.md)"
	@echo "make test-vm   boot the baked image under qemu (TCG, virtio, direct kernel boot) and check the cells in it"

sysdeps:
	@missing=""; for p in $(SYS_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; fi

$(VENV)/.stamp: requirements/py311.lock
	$(PY311) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements/py311.lock
	touch $@

venv: $(VENV)/.stamp devcoll

$(VENV312)/.stamp: requirements/py312.lock
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --disable-pip-version-check -r requirements/py312.lock
	touch $@

venv312: $(VENV312)/.stamp

devcoll:
	@mkdir -p $(DEVCOLL)/ansible_collections/chv
	@ln -sfn $(ROOT) $(DEVCOLL)/ansible_collections/chv/fleet
	@ln -sfn $(ROOT)/lab $(DEVCOLL)/ansible_collections/chv/fleet_lab

# mypy --strict over the guest-side programs (mypy.ini names them). It sees
# third-party packages through the browser's venv, the one that has any
# (playwright, which chv-browser imports; the others are stdlib only).
lint: venv browser-venv
	PATH=$(VENV)/bin:$$PATH ansible-lint
	$(VENV)/bin/mypy --python-executable $(BROWSER_VENV)/bin/python

# ansible-test needs the collection at .../ansible_collections/chv/fleet and a
# get-pip bootstrap it cannot download here (hack/get_pip_standin.py). It
# runs on what ships (the built tarball, installed) plus the sanity ignore
# files (tests/ does not ship).
define sanity_run
	rm -rf $(BUILD)/sanity-$(1) && mkdir -p $(BUILD)/sanity-$(1)
	$(2)/bin/ansible-galaxy collection build --force --output-path $(BUILD)/sanity-$(1) $(ROOT) >/dev/null
	$(2)/bin/ansible-galaxy collection install --force -p $(BUILD)/sanity-$(1)/coll $(BUILD)/sanity-$(1)/chv-fleet-*.tar.gz >/dev/null
	mkdir -p $(BUILD)/sanity-$(1)/coll/ansible_collections/chv/fleet/tests && \
	  cp -r $(ROOT)/tests/sanity $(BUILD)/sanity-$(1)/coll/ansible_collections/chv/fleet/tests/
	pipver=$$(grep -o "pip='[0-9.]*'" $(2)/lib/python*/site-packages/ansible_test/_internal/python_requirements.py | head -n1 | cut -d"'" -f2); \
	  mkdir -p $$HOME/.ansible/test/cache; cp hack/get_pip_standin.py $$HOME/.ansible/test/cache/get_pip_$${pipver//./_}.py
	cd $(BUILD)/sanity-$(1)/coll/ansible_collections/chv/fleet && git init -q . && git add -A >/dev/null && \
	  PATH=$(2)/bin:$$PATH ansible-test sanity --python $(1) --color no $(3)
endef

# The test lab's modules (lab/, not released) get the same sanity tests, on
# a copy of lab/ as ansible_collections/chv/fleet_lab (about 12 s here).
sanity: venv
	$(call sanity_run,3.11,$(VENV))
	rm -rf $(BUILD)/sanity-lab && mkdir -p $(BUILD)/sanity-lab/coll/ansible_collections/chv && \
	  cp -r $(ROOT)/lab $(BUILD)/sanity-lab/coll/ansible_collections/chv/fleet_lab
	cd $(BUILD)/sanity-lab/coll/ansible_collections/chv/fleet_lab && git init -q . && git add -A >/dev/null && \
	  PATH=$(VENV)/bin:$$PATH ansible-test sanity --python 3.11 --color no

$(BROWSER_VENV)/.stamp: requirements/browser.lock
	rm -rf $(BROWSER_VENV) && /usr/bin/python3 -m venv $(BROWSER_VENV)
	PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 $(BROWSER_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/browser.lock
	touch $@

browser-venv: $(BROWSER_VENV)/.stamp

# tests/unit: pure tests, no root, no processes of other uids, no namespaces.
# promtool, for the metrics' unit tests (tests/unit/metrics: check metrics, check and
# test rules) and the fleet scenario's test_metrics.py. Debian 12 ships it only inside the prometheus package, whose install
# also enables a Prometheus server: the package is unpacked under build/ instead.
PROMTOOL := $(BUILD)/promtool/usr/bin/promtool
$(PROMTOOL):
	rm -rf $(BUILD)/promtool && mkdir -p $(BUILD)/promtool/deb
	cd $(BUILD)/promtool/deb && { apt-get download -q prometheus 2>/dev/null || \
	  { apt-get update -q && apt-get download -q prometheus; }; }
	dpkg-deb -x $(BUILD)/promtool/deb/prometheus_*.deb $(BUILD)/promtool && rm -rf $(BUILD)/promtool/deb
	test -x $@

units: venv $(PROMTOOL)
	cd $(ROOT) && CHV_PROMTOOL=$(PROMTOOL) $(VENV)/bin/python -m pytest tests/unit -q -rfEs -p no:cacheprovider --durations=10

# tests/integration/<suite>: real kernel objects on this machine, as root.
#   cells:   the chv-cell launcher running real systemd-nspawn cells
#   netns:   the cell_nat ruleset loaded in network namespaces (and its playbook)
#   broker:  chv-broker on real Unix sockets, peers and git workers as cell uids
#   browser: chv-browser driving Debian's chromium through Playwright
#   playbooks: site.yml's rollout keywords on throwaway inventories (check mode)
integration-cells integration-netns integration-broker integration-playbooks: venv sysdeps
	cd $(ROOT) && $(VENV)/bin/python -m pytest tests/integration/$(@:integration-%=%) -q -rfEs -p no:cacheprovider --durations=10

integration-browser: venv browser-venv sysdeps
	cd $(ROOT) && CHV_BROWSER_PYTHON=$(BROWSER_VENV)/bin/python $(VENV)/bin/python -m pytest tests/integration/browser \
	  -q -rfEs -p no:cacheprovider --durations=10

integration: $(INTEGRATION:%=integration-%)

lab-tests: venv sysdeps
	cd $(ROOT) && $(VENV)/bin/python -m pytest tests/lab -q -rfEs -p no:cacheprovider --durations=10

molecule: $(SCENARIOS:%=molecule-%)

# promtool: molecule/shared/tests/test_metrics.py checks the scraped text with it
$(SCENARIOS:%=molecule-%): molecule-%: venv sysdeps $(PROMTOOL)
	PATH=$(VENV)/bin:$$PATH CHV_PROMTOOL=$(PROMTOOL) molecule test -s $*

# The second leg: Python 3.12 with ansible-core 2.21: every playbook
# loaded by 2.21 (--syntax-check: modules, roles and plugins resolved; the
# lint rules run once, on the first leg), sanity but pylint (which runs on
# the first leg) and the unit tests of the collection's plugins
# (tests/unit/plugins: filters, modules, module_utils), the code
# ansible-core loads. The launcher, broker
# and browser run on the guests' own Python (bookworm 3.11, trixie 3.13):
# their unit tests run once, on 3.11, and the trixie scenario runs them for
# real on 3.13.
test-leg312:
	@if [ -z "$(PY312)" ]; then \
	  if [ "$${CI:-}" = true ]; then echo "FAIL python3.12 leg: no python3.12 on this machine (CI=true: a leg that cannot run is a failure)"; exit 1; fi; \
	  echo "SKIP python3.12 leg: no python3.12 on this machine"; else \
	  $(MAKE) --no-print-directory venv312 && \
	  $(VENV312)/bin/ansible-playbook --syntax-check -i localhost, site.yml remove.yml playbooks/*.yml \
	    molecule/shared/*.yml >/dev/null && \
	  $(VENV312)/bin/python -m pytest tests/unit/plugins -q -p no:cacheprovider && \
	  $(MAKE) --no-print-directory sanity312; fi

# pylint runs on the first leg only (the same code, most of sanity's time)
sanity312: venv312
	$(call sanity_run,3.12,$(VENV312),--skip-test pylint)

# Everything two lanes share is built before they fan out (two lanes building
# build/promtool at once removed each other's download).
test: sysdeps venv $(PROMTOOL)
	@unlaned="$(filter-out $(foreach l,$(LANES),$(LANE_$(l))),$(SCENARIOS:%=molecule-%))"; \
	  if [ -n "$$unlaned" ]; then echo "make test: no lane runs$$unlaned (LANE_* in the Makefile)"; exit 1; fi
	@rm -rf $(BUILD)/lanes && mkdir -p $(BUILD)/lanes
	@rc=0; $(MAKE) --no-print-directory -j$(words $(LANES)) $(LANES:%=lane-%) || rc=$$?; \
	  $(PY311) hack/lane_summary.py $(BUILD)/lanes; exit $$rc

# A lane runs its stages in order and stops at the first that fails; each
# stage's wall-clock time is printed (where make test's time goes).
$(LANES:%=lane-%): lane-%:
	@mkdir -p $(BUILD)/lanes; for stage in $(LANE_$*); do start=$$(date +%s); \
	  if ! $(MAKE) --no-print-directory -j1 $$stage; then \
	    echo "make test: $$stage FAILED after $$(( $$(date +%s) - start )) s"; exit 1; fi; \
	  echo "make test: $$stage passed in $$(( $$(date +%s) - start )) s"; done 2>&1 | sed -u 's/^/[$*] /' \
	  | tee $(BUILD)/lanes/$*.log

build: venv
	mkdir -p $(BUILD)/dist
	$(VENV)/bin/ansible-galaxy collection build --force --output-path $(BUILD)/dist $(ROOT)

# The released collection as an operator gets it (tests/release): the
# tarball's members, installed into an empty collections path (ansible-doc,
# syntax check), the execution environment's build context, the changelog.
release-check: venv
	cd $(ROOT) && $(VENV)/bin/python -m pytest tests/release -q -p no:cacheprovider

demo: sysdeps venv
	PATH=$(VENV)/bin:$$PATH ansible-playbook lab/playbooks/lab_up.yml -e lab_name=$(DEMO_LAB) -e lab_network=10.99.20.0/28
	PATH=$(VENV)/bin:$$PATH ansible-playbook -i $(DEMO_INVENTORY) site.yml | tee $(BUILD)/demo-converge.log
	PYTHONPATH=$(ROOT)/src:$(ROOT)/tests/helpers $(VENV)/bin/python hack/demo_summary.py $(DEMO_INVENTORY) $(BUILD)/demo-converge.log

lab-down: venv
	PATH=$(VENV)/bin:$$PATH ansible-playbook lab/playbooks/lab_down.yml -e lab_name=$(DEMO_LAB) -e lab_network=10.99.20.0/28

# make bench: benchmarks, not tests (no timing assertions): each prints its
# medians and ratios and writes a fragment build/bench/NAME.md, which
# bench/report.py puts into docs/performance.md. The benchmarks of BENCH_ORDER
# run first, in that order (one not there yet is skipped), then any other
# bench/bench_*.py; a failing one does not stop the others, but fails make bench.
# The rollout benchmark keeps its lab and the cells and metrics benchmarks
# measure on its first guest (converged by site.yml already); the lab goes
# down after them.
BENCH_PACKAGES := iperf3
BENCH_ORDER := rollout cells metrics cell_identity
bench: venv sysdeps
	@$(MAKE) --no-print-directory sysdeps SYS_PACKAGES="$(BENCH_PACKAGES)"
	@export CHV_BENCH_KEEP_LAB=1 CHV_BENCH_LAB=brollout; \
	  start=$$(date +%s); failed=""; seen=""; mkdir -p $(BUILD)/bench; rm -f $(BUILD)/bench/*.md; \
	  ordered="$(BENCH_ORDER:%=bench/bench_%.py)"; \
	  for b in $$ordered $$(ls bench/bench_*.py); do \
	    case " $$seen " in *" $$b "*) continue;; esac; seen="$$seen $$b"; \
	    if [ ! -f $$b ]; then echo "== $$b: not there, skipped"; continue; fi; \
	    t=$$(date +%s); echo "== $$b"; \
	    if $(VENV)/bin/python $$b; then echo "== $$b: $$(( $$(date +%s) - t )) s"; \
	    else echo "== $$b FAILED after $$(( $$(date +%s) - t )) s"; failed="$$failed $$b"; fi; \
	    if [ $$b = bench/bench_metrics.py ]; then $(VENV)/bin/python bench/bench_rollout.py --lab-down || failed="$$failed lab-down"; fi; \
	  done; \
	  $(VENV)/bin/python bench/report.py; \
	  echo "make bench: $$(( $$(date +%s) - start )) s ($$(( ($$(date +%s) - start) / 60 )) min $$(( ($$(date +%s) - start) % 60 )) s)$${failed:+, FAILED:$$failed}"; \
	  [ -z "$$failed" ]

# The long fuzz run of docs/reliability.md: 34,000 generated inputs per
# target (chv-broker, chv-browser, the policy validator), 102,000 in all;
# make test runs the same tests with 1,000 per target (tests/unit).
fuzz: venv
	cd $(ROOT) && CHV_FUZZ_EXAMPLES=34000 $(VENV)/bin/python -m pytest tests/unit/test_protocol_fuzz.py -q -p no:cacheprovider
	@cat $(BUILD)/fuzz-counts.json; echo

# The docs site of what ships (hack/build_docs.py): antsibull-docs and Sphinx
# in a venv of their own (requirements/docs.lock: Sphinx needs an older
# docutils than the toolchain's), zero warnings, build/docs/html/index.html.
docs: venv
	PATH=$(VENV)/bin:$$PATH ROOT=$(ROOT) $(VENV)/bin/python hack/build_docs.py

# Regenerate the lock files from requirements/toolchain.in.
lock:
	rm -rf $(BUILD)/lock && $(PY311) -m venv $(BUILD)/lock/311
	$(BUILD)/lock/311/bin/pip install -q -r requirements/toolchain.in
	$(BUILD)/lock/311/bin/pip freeze --all | grep -v -E '^(pip|setuptools|wheel)==' > requirements/py311.lock
	$(PY312) -m venv $(BUILD)/lock/312
	$(BUILD)/lock/312/bin/pip install -q -r requirements/toolchain.in
	$(BUILD)/lock/312/bin/pip freeze --all | grep -v -E '^(pip|setuptools|wheel)==' > requirements/py312.lock
	$(PY311) -m venv $(BUILD)/lock/docs
	$(BUILD)/lock/docs/bin/pip install -q -c <(grep -v '^docutils==' requirements/py311.lock) -r requirements/docs.in
	$(BUILD)/lock/docs/bin/pip freeze --all | grep -v -E '^(pip|setuptools|wheel)==' > requirements/docs.lock

clean:
	rm -rf $(BUILD)

# The CHV guest image (docs/chv.md): lab/playbooks/bake_image.yml converges a
# lab guest with site.yml, generalizes it and writes build/image/IMAGE_NAME.qcow2
# with its kernel and initrd. make test-vm boots it with qemu (TCG) as a CHV
# guest and runs tests/vm (bakes the image first if there is none).
IMAGE_DISTRO ?= bookworm
IMAGE_DIR := $(BUILD)/image
IMAGE_NAME = chv-guest-$(IMAGE_DISTRO)
IMAGE_PACKAGES := qemu-utils fdisk e2fsprogs
VM_PACKAGES := qemu-system-x86 qemu-utils dosfstools mtools openssh-client
image: sysdeps venv
	@$(MAKE) --no-print-directory sysdeps SYS_PACKAGES="$(IMAGE_PACKAGES)"
	@start=$$(date +%s); PATH=$(VENV)/bin:$$PATH ansible-playbook lab/playbooks/bake_image.yml \
	  -e lab_bake_dest=$(IMAGE_DIR) -e lab_distro=$(IMAGE_DISTRO) | tee $(BUILD)/image-bake.log; \
	  echo "make image: $$(( $$(date +%s) - start )) s"

test-vm: venv
	@$(MAKE) --no-print-directory sysdeps SYS_PACKAGES="$(VM_PACKAGES)"
	@test -f $(IMAGE_DIR)/$(IMAGE_NAME).qcow2 || $(MAKE) --no-print-directory image
	@start=$$(date +%s); cd $(ROOT) && CHV_IMAGE=$(IMAGE_DIR)/$(IMAGE_NAME) \
	  CHV_VM_REPORT_DIR=$(BUILD)/reports/vm-$(IMAGE_DISTRO) $(VENV)/bin/python -m pytest tests/vm \
	  -v -p no:cacheprovider --durations=0; echo "make test-vm: $$(( $$(date +%s) - start )) s"
