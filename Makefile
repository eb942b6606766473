# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# The virtual environment lives outside the clone, keyed by the pinned versions,
# so clones and CI runs reuse it; XLADIST_VENV overrides its location.
PYTHON ?= python3
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
XLADIST_VENV ?= $(HOME)/.cache/xladist/venv-torch2.9.0-xla2.9.0-py$(PYVER)
PY := $(XLADIST_VENV)/bin/python
# The venv holds an editable install (PEP 660) of one clone's xladist: imports
# read this working tree, so edits need no reinstall. The stamp names the clone
# and pyproject.toml: another clone sharing the venv, or new dependencies,
# install again (and the last clone to install is the one the venv imports).
STAMP := $(XLADIST_VENV)/.xladist-$(shell (sha1sum pyproject.toml; echo '$(CURDIR)') | sha1sum | cut -c1-12)
# Optional: an index to take torch from, installed before the rest; e.g. PyTorch's
# CPU-only wheels, in a new venv (README): `make clean-venv`, then
#   make venv TORCH_INDEX_URL=<cpu-index-url>
TORCH_INDEX_URL ?=
RUN := $(PY)
CPU_ENV := PJRT_DEVICE=CPU CPU_NUM_DEVICES=4
# A clone runs its own code: the venvs are shared between clones and their editable
# install points at the clone that installed last, so this clone comes first on every
# interpreter's path, and `own-code` (before the tests and the demo) fails loudly if
# `import xladist` still finds another tree (tests/test_clone_own_code.py).
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH),)
# (without `-c`'s current directory on the path, as a script such as the demo runs;
# the import system's own search, find_spec, without running xladist's imports:
# seconds of torch per interpreter, nine times in `make test`)
WHERE_XLADIST := -c 'import sys; del sys.path[0]; import os, importlib.util; \
	spec = importlib.util.find_spec("xladist"); \
	print(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) if spec else "nowhere")'

.PHONY: own-code which-xladist test-ecosystem test-jax-matrix test-xla-ecosystem test-jax-ecosystem bench-scaling bench-phases bench-memory bench-sharding bench-sharding-depth venv venv-jax venv-jax-new test-jax test-jax-old test-jax-new test-xla check demo charlm demo-ps bench-ps test lint bench bench-input bench-collectives bench-logical \
	gpu-wheels gpu-check \
	bench-first-step bench-checkpoint bench-replay-ab plots clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(XLADIST_VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX_URL),$(PY) -m pip install --quiet "torch==2.9.0" --index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install --quiet --editable "$(CURDIR)[xla,dev,ecosystem]" "torchvision==0.24.0"
	@rm -f $(XLADIST_VENV)/.xladist-*
	@touch $@

# BACKEND=jax runs it on the jax runtime (its own environment, `make venv-jax`).
BACKEND ?= torch_xla
ifeq ($(BACKEND),jax)
demo: venv-jax own-code
	XLADIST_BACKEND=jax $(JAX_PY) examples/train_digits.py
else
demo: venv own-code
	$(RUN) examples/train_digits.py
endif

# Which xladist each environment that exists imports here (one line each).
which-xladist:
	@for py in $(PY) $(JAX_PY) $(JAX_NEW_PY); do test ! -x $$py || $$py $(WHERE_XLADIST); done

own-code:
	@for py in $(PY) $(JAX_PY) $(JAX_NEW_PY); do test ! -x $$py || { \
	  where=$$($$py $(WHERE_XLADIST)) && test "$$where" = "$$(realpath $(CURDIR))" || { \
	  echo "make: $$py imports xladist from '$$where', not from this clone ($(CURDIR))" >&2; exit 1; }; }; done

# The second example: a character-level transformer LM on the standard library's
# sources; ARGS=--resume continues from the newest checkpoint.
charlm: venv
	$(RUN) examples/train_charlm.py $(ARGS)

# Parameter servers: starts 2 workers and 2 ps tasks on this machine itself.
demo-ps: venv
	$(RUN) examples/parameter_server.py

LINT_PATHS := xladist tests bench examples

# The three suites share no state (each its own processes, environment, ports and
# temporary folders): they run side by side, each printing its output when it ends
# and how long it took. docs/testing.md has the measurements behind this.
# The torch_xla suite needs the most CPU (about 490 of 1,350 CPU-s); at equal priority
# the jax suites ended 57-90 s before it, one core idle meanwhile. At nice 1 they yield
# it a little more CPU while all three run (docs/testing.md).
test: venv venv-jax venv-jax-new lint
	@$(MAKE) --no-print-directory -j3 --output-sync=target JAX_NICE="nice -n 1" test-xla test-jax-old test-jax-new

# `[time] NAME: N s` after a command, keeping its exit status.
TIMED = start=$$(date +%s); $(1); rc=$$?; echo "[time] $@: $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

test-xla: venv own-code
	@$(call TIMED,$(CPU_ENV) $(RUN) -m pytest -q -p no:cacheprovider -m "not ecosystem_matrix" tests --ignore=tests/runtime_jax)

# The ecosystem's nine models x two loops (tests/ecosystem/test_models.py) on
# torch_xla and on jax 0.10.2, side by side, and the optimizer x scheduler matrix's
# 15-models cases on jax 0.10.2 (`test-jax-matrix`): about 5 minutes more, so not in
# `make test` (kept at 12 minutes); `.ci/run` runs it after `make test`. `make test` runs
# the rest of tests/ecosystem (the import order, the Hugging Face example) everywhere.
# Each runtime's models run in three processes of three models each: every compiled
# XLA:CPU program keeps memory mappings, and one process that compiled the 18 cases
# came near the kernel's limit of 65,530 (45,593 mappings after 7 jax cases; a
# segmentation fault inside XLA's compiler, docs/testing.md).
ECOSYSTEM_GROUPS := "gpt2 or llama or bert" "t5 or resnet18 or mobilenet" "vit or convnext"
ecosystem_groups = rc=0; for k in $(ECOSYSTEM_GROUPS); do $(1) -m pytest -q -p no:cacheprovider \
	-m ecosystem_matrix tests/ecosystem -k "$$k" || rc=1; done; test $$rc = 0

test-ecosystem: venv venv-jax
	@$(MAKE) --no-print-directory -j3 --output-sync=target test-xla-ecosystem test-jax-ecosystem test-jax-matrix

test-xla-ecosystem: venv
	@$(call TIMED,$(call ecosystem_groups,$(CPU_ENV) $(RUN)))

test-jax-ecosystem: venv venv-jax
	@$(call TIMED,$(call ecosystem_groups,$(JAX_TEST_ENV) XLA_FLAGS=--xla_force_host_platform_device_count=4 \
	  JAX_DEFAULT_MATMUL_PRECISION=highest $(JAX_PY)))

# The inner loop (at most 3 minutes): lint, the unit tests (tests/unit: the pure
# pieces, no XLA compile, seconds), then the tests a change most often breaks (the
# step engine, replay, variables, the runtime contract) on torch_xla.
# `make test` (everything, both runtimes) before a change lands.
CHECK_TESTS := tests/unit tests/test_replay.py tests/test_run_steps.py tests/test_variables.py \
	tests/test_tf_variables.py tests/test_compile_watch.py tests/test_strategy.py \
	tests/test_training.py tests/test_replica_context.py tests/test_values.py \
	tests/test_losses_and_clipping.py tests/shared tests/runtime_contract
check: venv lint own-code
	@$(call TIMED,$(CPU_ENV) $(RUN) -m pytest -q -p no:cacheprovider $(CHECK_TESTS))

# The jax runtime (XLADIST_BACKEND=jax) is tested in an environment of its own:
# torchax cannot share torch_xla's (torch_xla 2.9.0 bundles an old torchax).
# tests/shared (TF semantics) and tests/runtime_contract (the runtime contract) run on
# both runtimes; tests/runtime_jax on jax only.
# Versions: torch 2.9.0, jax 0.10.2, torchax 0.0.13, the oldest supported (the jax
# runtime does not need torch_xla); venv-jax-new below holds the newest.
XLADIST_JAX_VENV ?= $(HOME)/.cache/xladist/venv-jax-torch2.9.0-jax0.10.2-torchax0.0.13-py$(PYVER)
JAX_PY := $(XLADIST_JAX_VENV)/bin/python
JAX_REQUIREMENTS := "torch==2.9.0" "jax[cpu]==0.10.2" "torchax==0.0.13" "torchvision==0.24.0"
JAX_STAMP := $(XLADIST_JAX_VENV)/.xladist-$(shell (sha1sum pyproject.toml Makefile; echo '$(CURDIR)') | sha1sum | cut -c1-12)

venv-jax: $(JAX_STAMP)

$(JAX_STAMP): pyproject.toml Makefile
	@test -x $(JAX_PY) || $(PYTHON) -m venv $(XLADIST_JAX_VENV)
	$(JAX_PY) -m pip install --quiet --upgrade pip
	$(JAX_PY) -m pip install --quiet $(JAX_REQUIREMENTS)
	$(JAX_PY) -m pip install --quiet --editable "$(CURDIR)[jax,dev,ecosystem]" $(JAX_REQUIREMENTS)
	@rm -f $(XLADIST_JAX_VENV)/.xladist-*
	@touch $@

# A second jax environment, the newest versions installable here: Python 3.12,
# torch 2.14.1 (PyPI's wheel, with its CUDA libraries: several GB, once), jax
# 0.12.0.1, torchax 0.0.13. XLADIST_JAX_NEW_VENV overrides its location,
# JAX_NEW_PYTHON the interpreter (default: the first Python 3.12 found).
JAX_NEW_PYTHON ?= $(firstword $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null) \
	$(wildcard /usr/bin/python3.12 /usr/local/bin/python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12))
XLADIST_JAX_NEW_VENV ?= $(HOME)/.cache/xladist/venv-jax-torch2.14.1-jax0.12.0.1-torchax0.0.13-py3.12
JAX_NEW_PY := $(XLADIST_JAX_NEW_VENV)/bin/python
JAX_NEW_REQUIREMENTS := "torch==2.14.1" "jax[cpu]==0.12.0.1" "torchax==0.0.13" "torchvision==0.29.1"
JAX_NEW_STAMP := $(XLADIST_JAX_NEW_VENV)/.xladist-$(shell (sha1sum pyproject.toml Makefile; echo '$(CURDIR)') | sha1sum | cut -c1-12)

venv-jax-new: $(JAX_NEW_STAMP)

$(JAX_NEW_STAMP): pyproject.toml Makefile
	@test -x $(JAX_NEW_PY) || test -n "$(JAX_NEW_PYTHON)" || { echo "venv-jax-new needs \
	  Python 3.12: none found; name one with JAX_NEW_PYTHON=/path/to/python3.12" >&2; exit 1; }
	@test -x $(JAX_NEW_PY) || $(JAX_NEW_PYTHON) -m venv $(XLADIST_JAX_NEW_VENV)
	$(JAX_NEW_PY) -m pip install --quiet --upgrade pip
	$(JAX_NEW_PY) -m pip install --quiet $(JAX_NEW_REQUIREMENTS)
	$(JAX_NEW_PY) -m pip install --quiet --editable "$(CURDIR)[jax,dev,ecosystem]" $(JAX_NEW_REQUIREMENTS)
	@rm -f $(XLADIST_JAX_NEW_VENV)/.xladist-*
	@touch $@

# XLADIST_XLA_PYTHON: the torch_xla environment, for checkpoints read across runtimes.
# Both jax environments run the same tests: the oldest and the newest versions
# supported (jax_compat.py, torchax_load.py).
JAX_TESTS := tests/runtime_jax tests/shared tests/runtime_contract tests/ecosystem
JAX_TEST_ENV := XLADIST_BACKEND=jax JAX_PLATFORMS=cpu XLADIST_XLA_PYTHON=$(PY)
JAX_NICE ?=
test-jax: venv venv-jax venv-jax-new
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-jax-old test-jax-new

test-jax-old: venv venv-jax own-code
	@$(call TIMED,$(JAX_TEST_ENV) $(JAX_NICE) $(JAX_PY) -m pytest -q -p no:cacheprovider -m "not full_matrix and not ecosystem_matrix and not xla_depth" $(JAX_TESTS))

# The optimizer x scheduler matrix's 15-models-per-step cases on jax 0.10.2 (12 cases,
# about 120 CPU-s: a tenth of `make test`'s CPU on two cores): in `make test-ecosystem`,
# which `.ci/run` runs after `make test`; torch_xla runs them in `make test`, and both jax
# environments run the one-loop cases (every optimizer and scheduler) there.
test-jax-matrix: venv-jax own-code
	@$(call TIMED,$(JAX_TEST_ENV) $(JAX_PY) -m pytest -q -p no:cacheprovider -m full_matrix tests/shared/test_optimizers_and_schedulers.py)

# (Like test-jax-old: the 15-models matrix cases are test-jax-matrix's.)
test-jax-new: venv venv-jax-new own-code
	@$(call TIMED,$(JAX_TEST_ENV) $(JAX_NICE) $(JAX_NEW_PY) -m pytest -q -p no:cacheprovider -m "not full_matrix and not ecosystem_matrix and not xla_depth" $(JAX_TESTS))

# Style (ruff, settings in pyproject.toml) and the one-way layers of the package
# (import-linter's contracts in pyproject.toml).
lint: venv
	@$(call TIMED,$(PY) -m ruff check $(LINT_PATHS) && $(PY) -m ruff format --check $(LINT_PATHS) && $(XLADIST_VENV)/bin/lint-imports)

bench: venv
	$(CPU_ENV) $(RUN) bench/step_overhead.py

# Replay's per-step host cost against another revision (BASE), alternating in one run.
BASE ?= HEAD~1
bench-replay-ab: venv
	$(CPU_ENV) $(RUN) bench/replay_ab.py --base $(BASE)

# The replayed AdamW + cosine step at 4, 32, 128 and 512 parameter tensors; BACKEND=jax
# runs it on the jax runtime beside hand-written jax.jit + optax (alternating rounds).
# bench-phases: a replayed step's host time by phase (signature, key, guards, ...).
ifeq ($(BACKEND),jax)
bench-scaling: venv-jax
	XLADIST_BACKEND=jax JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \
	  $(JAX_PY) bench/replay_scaling.py
bench-phases: venv-jax
	XLADIST_BACKEND=jax JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \
	  $(JAX_PY) bench/replay_phases.py
else
bench-scaling: venv
	$(CPU_ENV) $(RUN) bench/replay_scaling.py
bench-phases: venv
	$(CPU_ENV) $(RUN) bench/replay_phases.py
endif

# Peak memory (RSS over imports) of 20 AdamW steps at 8.4M and 25.2M parameters, each
# variant in a process of its own, against hand-written torch_xla SPMD; BACKEND=jax
# runs xladist on the jax runtime beside hand-written jax.jit + optax (the torch_xla
# reference runs in the torch_xla environment).
ifeq ($(BACKEND),jax)
bench-memory: venv venv-jax
	XLADIST_BACKEND=jax $(JAX_PY) bench/memory.py --xla-python $(PY)
else
bench-memory: venv
	$(CPU_ENV) $(RUN) bench/memory.py
endif

# Sharded state (issue 51): MirroredStrategy and ShardingOptions(shard="optimizer_state",
# "gradients", "parameters") on the 25.2M-parameter MLP, beside hand-written torch_xla
# FSDPv2 and jax.jit with NamedSharding (in the jax environment): state bytes, peak RSS
# over imports and step time, each variant in a process of its own (about 3 minutes).
# ARGS=--jax adds xladist on the jax runtime (about 6 minutes in all).
bench-sharding: venv venv-jax
	$(RUN) bench/sharding.py --jax-python $(JAX_PY) $(ARGS)

# ZeRO-3's peak inside a step by depth (issue 60): 16/32/64 x Linear(1024, 1024), SGD,
# xladist Mirrored and "parameters" on both runtimes beside torch_xla FSDPv2 and
# hand-written jax FSDP (scan, with and without jax.checkpoint): program bytes per
# device, peak RSS, step time (about 8 minutes). ARGS="--optimizer adamw --depths 32".
bench-sharding-depth: venv venv-jax
	$(RUN) bench/sharding_depth.py --jax-python $(JAX_PY) $(ARGS)

bench-input: venv
	$(CPU_ENV) $(RUN) bench/input_pipeline.py --rounds 12

bench-collectives: venv
	$(CPU_ENV) $(RUN) bench/collectives.py

bench-logical: venv
	$(CPU_ENV) $(RUN) bench/logical_devices.py

bench-first-step: venv
	$(CPU_ENV) $(RUN) bench/first_step.py

bench-ps: venv
	$(RUN) bench/parameter_server.py

bench-checkpoint: venv
	$(CPU_ENV) $(RUN) bench/checkpoint.py

# Every benchmark's figure (docs/img/*.png, shown in the README); regenerate on a
# quiet machine: these are single runs.
plots: venv venv-jax
	$(CPU_ENV) $(RUN) bench/step_overhead.py --plot
	$(CPU_ENV) $(RUN) bench/input_pipeline.py --rounds 12 --plot
	$(CPU_ENV) $(RUN) bench/collectives.py --skip-packing --plot
	$(CPU_ENV) $(RUN) bench/steps_per_execution.py --plot
	$(CPU_ENV) $(RUN) bench/logical_devices.py --plot
	$(RUN) bench/sharding.py --jax-python $(JAX_PY) --plot

clean-venv:
	rm -rf $(XLADIST_VENV)

# The GPU check (bench/gpu_check.sh): `make gpu-wheels` here fills .gpu-wheels/ with
# the wheels a lent GPU machine lacks (it has no network): torchax and pure-Python or
# cp312 wheels, under the device tool's 64 MiB; then the device tool runs
# `bash bench/gpu_check.sh` there with carry=[".gpu-wheels"] (`make gpu-check` runs it
# on a machine of your own with a GPU).
GPU_WHEELS := torchax==0.0.13 optree cloudpickle tqdm scikit-learn joblib threadpoolctl \
	pytest pluggy iniconfig packaging hypothesis attrs sortedcontainers typing-extensions
gpu-wheels:
	rm -rf .gpu-wheels
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --dest .gpu-wheels \
	  --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux_2_28_x86_64 $(GPU_WHEELS)
	du -sh .gpu-wheels

gpu-check:
	bash bench/gpu_check.sh
