# dflashctl: set-up, tests, demo and benchmarks. Each target installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The torch the trainer is tested with. On a machine without GPUs, take PyTorch's CPU
# build instead of PyPI's much larger CUDA one:
# TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu'.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP  := $(VENV)/.installed

.PHONY: install system-deps test test-unit test-min demo demo-crash demo-recover bench lint clean schemas

install: $(STAMP)

# editable_mode=compat: the editable install's .pth file only names the checkout. The
# default one imports a finder (pathlib, urllib, ipaddress) as Python starts, before
# dflashctl can take Ctrl-C: a Ctrl-C then died with a traceback from importlib.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[trainer,dev]' \
	  --config-settings editable_mode=compat
	touch $@

# The tests' real SSH host needs sshd, nsenter and LXC (bubblewrap where LXC cannot start
# a container). Install them with apt when we are root and they are missing; otherwise
# those tests skip and say why.
system-deps:
	@missing=""; \
	command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v lxc-attach >/dev/null 2>&1 || missing="$$missing lxc"; \
	command -v nsenter >/dev/null 2>&1 || missing="$$missing util-linux"; \
	command -v ssh >/dev/null 2>&1 || missing="$$missing openssh-client"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "note: missing$$missing (need root + apt); the SSH/container tests will skip"; \
	  fi; \
	fi

# Two processes share the test files out (each with its own test hosts; the tiny trainer
# runs are trained once and shared): 19 min against 40 on a 2-core machine. Four are
# slower there (28 min 42 s against 24 min 48 s for two, idle, 2026-12-07): the
# container tests then fight for the cores. TEST_WORKERS=0 runs them all in this one.
# Each run gets a temporary folder of its own (--basetemp): in pytest's shared numbered
# folders, a second run beside this one could clean up folders this one still uses.
TEST_WORKERS ?= 2
test: install system-deps
	@base=$$(mktemp -d "$${TMPDIR:-/tmp}/dflashctl-test.XXXXXX"); \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --basetemp="$$base/t" $(PYTEST_ARGS); \
	status=$$?; if [ $$status -eq 0 ]; then rm -rf "$$base"; else echo "test files kept in $$base"; fi; \
	exit $$status

# The unit tier: every test that needs no test host (no sshd, no container, no pct
# stand-in), no tiny trainer runs, and runs neither the real trainer nor whole deploys;
# tests/conftest.py marks the others `host`. `make test` runs both tiers.
test-unit: install
	@base=$$(mktemp -d "$${TMPDIR:-/tmp}/dflashctl-test.XXXXXX"); start=$$(date +%s); \
	$(BIN)/pytest -q -m "not host" -n $(TEST_WORKERS) --dist loadfile --basetemp="$$base/t" $(PYTEST_ARGS); \
	status=$$?; echo "unit tier: $$(( $$(date +%s) - start )) s"; \
	if [ $$status -eq 0 ]; then rm -rf "$$base"; else echo "test files kept in $$base"; fi; \
	exit $$status

# The declared minimum of every dependency (pyproject.toml's `>=`, pinned by
# .ci/min_pins.py) in a venv of its own, running the CLI and host tests (no torch).
MIN_VENV  ?= .venv-min
MIN_STAMP := $(MIN_VENV)/.installed
MIN_TESTS ?= tests/test_help.py tests/test_interrupt.py tests/test_not_proxmox.py \
	tests/test_config.py tests/test_hints.py tests/test_proxmox_api.py tests/test_proxmox_pct.py \
	tests/test_transport_connect.py tests/test_transport_local.py tests/test_deploy.py \
	tests/test_status.py tests/test_stop.py tests/test_runs.py tests/test_logs.py

$(MIN_STAMP): pyproject.toml .ci/min_pins.py
	rm -rf $(MIN_VENV)
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/pip install --quiet --disable-pip-version-check \
	  $$($(PYTHON) .ci/min_pins.py) "pytest>=8" "pytest-timeout>=2.3"
	$(MIN_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e . \
	  --config-settings editable_mode=compat
	touch $@

test-min: $(MIN_STAMP) system-deps
	$(MIN_VENV)/bin/python .ci/min_pins.py --check
	$(MIN_VENV)/bin/pytest -q -p no:cacheprovider $(MIN_TESTS)

demo: install
	$(BIN)/dflashctl deploy --config templates/demo.yaml

# The same run with a failure injected into the drafter-0 thread at step 3: dflashctl
# shows the crash panel naming the thread and exits 1 (make then reports "Error 1").
demo-crash: install
	@$(BIN)/dflashctl deploy --config templates/demo.yaml -- --set debug.fail_in=drafter-0@step:3; \
	status=$$?; echo "dflashctl exited with $$status (1 = the run crashed, as intended here)"; exit $$status

# The same run killed with SIGKILL at step 250 (as the OOM killer would), once: the
# run's supervisor restarts it by itself from the step-200 checkpoint (run.retry), and
# dflashctl follows it across the restart to the end (exit 0).
demo-recover: install
	@rm -f demo/fail-once
	$(BIN)/dflashctl deploy --config templates/demo.yaml -- --set debug.fail_in=drafter-0@step:250 \
	  --set debug.fail_kind=sigkill --set debug.fail_once_marker=$(CURDIR)/demo/fail-once \
	  --set train.checkpoint_every=100

bench: install system-deps
	$(BIN)/python bench/run_all.py

lint: install
	$(BIN)/ruff check dflashctl trainer tests bench
	$(BIN)/ruff format --check dflashctl trainer tests bench

clean:
	rm -rf $(VENV) $(MIN_VENV) demo .pytest_cache .ruff_cache *.egg-info

# The JSON Schemas of the --json answers, made from dflashctl/ui/json_schemas.py's models.
schemas: install
	$(BIN)/python -m dflashctl.ui.json_schemas
