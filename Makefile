# Two commands set everything up from a fresh clone: `make demo` and `make test`.
# torch is pinned here, not in the package metadata: an unpinned torch resolves to a
# multi-GB CUDA build, while users elsewhere may bring any torch >= 2.3.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
READY := $(VENV)/.ready

.PHONY: demo test lint bench balance clean gpu-check

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[lab,dev,data,plots,frameworks]"
	# MovieLens-100K ships in recbole, whose own dependency pins are unusable: no deps.
	$(PY) -m pip install --quiet --no-deps recbole
	touch $@

demo: $(READY)
	$(VENV)/bin/microsparse train --workers 4 --out runs/demo

test: $(READY)
	$(PY) -m pytest tests src/microsparse src/microsparse_lab

# The benchmarks of docs/results/TOOLS.md, into $(BENCH); the plots are copied to docs/img.
# About two hours on 2 busy cores (bench select alone about one). One torch thread by default: on a busy machine, 2 threads
# make small kernels wait on each other; set BENCH_FLAGS= to use torch's default.
BENCH ?= runs/bench
BENCH_FLAGS ?= --threads 1
MICROSPARSE := $(VENV)/bin/microsparse
BALANCE_VARIANTS := micro,micro(selection=threshold),micro(partitioning=contiguous),micro(selection=threshold,partitioning=contiguous),micro-reference
BALANCE_FLAGS = --workers 4,16,64 --steps 40 --warmup 5 $(BENCH_FLAGS)

bench: $(READY)
	$(MICROSPARSE) bench overhead --out $(BENCH)/overhead
	$(MICROSPARSE) bench select $(BENCH_FLAGS) --out $(BENCH)/select
	$(MICROSPARSE) train --workers 4 --max-steps 150 --capture-gradients $(BENCH)/capture \
		--capture-steps 150 --no-progress --out $(BENCH)/capture-train
	$(MICROSPARSE) bench controller --capture $(BENCH)/capture $(BENCH_FLAGS) \
		--out $(BENCH)/controller
	if [ "$$(id -u)" = 0 ]; then $(MICROSPARSE) bench cluster --quick --out $(BENCH)/cluster; fi
	$(MICROSPARSE) simulate --capture $(BENCH)/capture --predict --workers 1,4,16,64,256,1024 \
		--select-results $(BENCH)/select/select.json \
		--cluster-results $(BENCH)/cluster/results.json $(BENCH_FLAGS) --out $(BENCH)/simulate
	$(MICROSPARSE) simulate --from $(BENCH)/simulate/simulate.json --predict --algorithms best \
		--select-results $(BENCH)/select/select.json --out $(BENCH)/simulate-best
	$(MAKE) balance
	mkdir -p docs/img
	cp $(BENCH)/select/*.png $(BENCH)/controller/*.png $(BENCH)/simulate/*.png docs/img/
	cp $(BENCH)/simulate-best/predict.png docs/img/predict-best.png

# On a machine with a GPU and torch already installed (no venv, no downloads): the CUDA and
# NCCL checks and the GPU benchmark of src/microsparse_lab/bench/gpu_check.py (about 4 minutes),
# into $OUT if it is set.
gpu-check:
	PYTHONPATH=src $(PYTHON) -m microsparse_lab.bench.gpu_check --out "$${OUT:-runs/gpu-check}"

lint: $(READY)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs

# MiCRO's per-rank balance, wire bytes and per-step passes: docs/results/runs/2026-11-30_balance.md.
balance: $(READY)
	test -d $(BENCH)/capture || $(MICROSPARSE) train --workers 4 --max-steps 150 \
		--capture-gradients $(BENCH)/capture --capture-steps 150 --no-progress --out $(BENCH)/capture-train
	test -d $(BENCH)/capture-lm || $(MICROSPARSE) train --task lm --workers 4 --max-steps 80 \
		--capture-gradients $(BENCH)/capture-lm --capture-steps 80 --no-progress \
		--out $(BENCH)/capture-lm-train
	$(MICROSPARSE) simulate --capture $(BENCH)/capture --density 0.001 --sparsifiers '$(BALANCE_VARIANTS)' $(BALANCE_FLAGS) --out $(BENCH)/balance/cnn
	$(MICROSPARSE) simulate --capture $(BENCH)/capture-lm --density 0.001 --sparsifiers '$(BALANCE_VARIANTS)' $(BALANCE_FLAGS) --out $(BENCH)/balance/lstm
	$(MICROSPARSE) simulate --capture $(BENCH)/capture --density 0.05 --sparsifiers '$(BALANCE_VARIANTS)' $(BALANCE_FLAGS) --out $(BENCH)/balance/cnn-paper-k
	$(MICROSPARSE) simulate --capture $(BENCH)/capture-lm --density 0.015 --sparsifiers '$(BALANCE_VARIANTS)' $(BALANCE_FLAGS) --out $(BENCH)/balance/lstm-paper-k
	$(MICROSPARSE) simulate --capture $(BENCH)/capture --density 0.05 --sparsifiers 'micro,micro(selection=threshold)' --value-dtype bfloat16 $(BALANCE_FLAGS) --out $(BENCH)/balance/cnn-paper-k-bf16
	$(MICROSPARSE) bench select --sizes 11173962 --partitions 1,4,16,64,256 \
		--sparsifiers 'micro,micro(selection=threshold),micro-reference' $(BENCH_FLAGS) --out $(BENCH)/balance/select
