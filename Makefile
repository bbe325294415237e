# Set-up and the two everyday commands. `make demo` and `make test` create .venv on first use
# (and install Debian's chromium for the browser test when it is missing).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch (installed from a local wheel on the project's standard machine);
# override on a GPU host, e.g. `make test TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

# The GPU check, for a GPU host's short window: that host's own python3 (torch, triton, pytest
# already installed; no network) with qkv from this tree. Nothing is installed, no venv made.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=

# The tests' base seed (tests/seeds.py): fixed, so that a run never fails on a lucky or unlucky
# draw; `make test QKV_TEST_SEED=fresh` explores new inputs (a failure prints its replay line).
QKV_TEST_SEED ?= 1
# Two workers, each taking the next test when it is free (a long test does not hold up a queue).
PYTEST := QKV_TEST_SEED=$(QKV_TEST_SEED) $(PY) -m pytest -n 2 --dist worksteal -q

.PHONY: setup demo test test-slow docs bench gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@# Debian's Chromium for the HTML pages' browser tests, and a CJK font so Chinese figure labels
	@# render (root on the project's machines; both are optional: their tests skip without them).
	command -v chromium >/dev/null && command -v chromedriver >/dev/null && fc-list :lang=zh | grep -q . || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver fonts-wqy-microhei) || \
	  echo "warning: could not install chromium or a CJK font; the browser and Chinese-figure tests will be skipped"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	@# qkv's C kernels for the CPU, built now rather than on first use (optional: without a
	@# C compiler qkv uses torch operations instead)
	$(PY) -c "from qkv.backends import native; print('native CPU kernels:', native.status())"
	touch $@

demo: setup
	$(VENV)/bin/qkv demo

test: setup
	$(PYTEST) -m "not slow"

# Further cases of paths the quick tier already proves (tests marked slow); CI runs them after `make test`.
test-slow: setup
	$(PYTEST) -m slow

# The documentation site, built offline into build/site (strict: a warning is an error).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

bench: setup
	$(PY) bench/attention_cpu.py

# ≤ 7 minutes: the device tests, the autotune of every kernel, the benchmark, then the heavy tests on what is left
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
