# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# The virtual environment lives outside the clone, keyed by the pinned versions,
# so clones and CI runs reuse it; XLADIST_VENV overrides its location.
PYTHON ?= python3
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
XLADIST_VENV ?= $(HOME)/.cache/xladist/venv-torch2.9.0-xla2.9.0-py$(PYVER)
PY := $(XLADIST_VENV)/bin/python
STAMP := $(XLADIST_VENV)/.xladist-$(shell sha1sum pyproject.toml | cut -c1-12)
# Tests and the demo run the working tree's xladist, not an installed copy.
RUN := PYTHONPATH=$(CURDIR) $(PY)
CPU_ENV := PJRT_DEVICE=CPU CPU_NUM_DEVICES=4

.PHONY: venv demo test bench bench-input bench-collectives bench-logical clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(XLADIST_VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(CURDIR)[dev]"
	@touch $@

demo: venv
	$(RUN) examples/train_digits.py

test: venv
	$(CPU_ENV) $(RUN) -m pytest -q tests

bench: venv
	$(CPU_ENV) $(RUN) bench/step_overhead.py

bench-input: venv
	$(CPU_ENV) $(RUN) bench/input_pipeline.py --rounds 12

bench-collectives: venv
	$(CPU_ENV) $(RUN) bench/collectives.py

bench-logical: venv
	$(CPU_ENV) $(RUN) bench/logical_devices.py

clean-venv:
	rm -rf $(XLADIST_VENV)
