# GPU Ledger — `make help` lists the targets.
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install demo test test-unit chaos slurm-check slurm-check-24 slurm-check-26 slurm-check-src bench bench-profile schemas superset-check clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# setuptools notes that an editable install of a package-dir mapping (agents/ -> gpuledger.agents)
	@# uses an import finder: information on every install, not a warning about this project
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install gpuledger with its test extras

demo: $(STAMP) ## run the whole pipeline on the embedded default (Tansu + chDB) and print the reports
	$(BIN)/gpuledger demo

test: $(STAMP) ## install and run every test (unit + integration on Tansu + chDB; Docker tests skip without Docker)
	$(BIN)/python -m pytest -q

test-unit: $(STAMP) ## unit tests of the pure core only
	$(BIN)/python -m pytest -q -m "not integration and not docker"

chaos: $(STAMP) ## fault-injection suite: kill -9 worker/sink, freeze broker, cut clients off, warehouse outage; bills must equal the fault-free run (~5 min)
	$(BIN)/python -m pytest -q -s -m chaos tests/chaos

slurm-check: $(STAMP) ## real Slurm 22.05 cluster (4 fake 8-GPU nodes) + Slurm agent + pipeline: ledger GPU-seconds, outcomes, attempts vs sacct (~2.5 min; docs/slurm.md)
	$(BIN)/python -m pytest -q -s -m slurm tests/slurm

SLURM24_ROOT ?= /srv/gpuledger-slurm24
slurm-check-24: $(STAMP) ## the same check on Slurm 24.11.5 (Debian trixie in a chroot at SLURM24_ROOT, made when missing: ~40 s)
	scripts/slurm/newer_slurm.sh root $(SLURM24_ROOT) trixie
	SLURM_CHROOT=$(SLURM24_ROOT) $(BIN)/python -m pytest -q -s -m slurm tests/slurm

SLURM26_ROOT ?= /srv/gpuledger-slurm26
slurm-check-26: $(STAMP) ## the same check on Debian testing's Slurm (26.05.5 on 2026-12-07; it moves with testing, so not in CI)
	scripts/slurm/newer_slurm.sh root $(SLURM26_ROOT) forky
	SLURM_CHROOT=$(SLURM26_ROOT) $(BIN)/python -m pytest -q -s -m slurm tests/slurm

SLURM_SRC_ROOT ?= /srv/gpuledger-slurm-src
slurm-check-src: $(STAMP) ## the same check on Slurm built from SchedMD's source: SLURM_SRC=<unpacked release> (23.02, 23.11, 25.05, 25.11: no Debian suite has them; ~4 min to build here, once)
	@if [ -n "$(SLURM_SRC)" ]; then scripts/slurm/newer_slurm.sh source $(SLURM_SRC_ROOT) $(SLURM_SRC); \
	elif [ ! -x $(SLURM_SRC_ROOT)/usr/sbin/slurmctld ]; then echo "set SLURM_SRC to an unpacked Slurm release (docs/slurm.md)"; exit 2; fi
	SLURM_CHROOT=$(SLURM_SRC_ROOT) $(BIN)/python -m pytest -q -s -m slurm tests/slurm

bench: $(STAMP) ## run every benchmark (~30 min on 2 cores; GPULEDGER_BENCH_QUICK=1 for a ~4 min smoke run), print a table, write bench/results.json
	$(BIN)/python -m bench.run

bench-profile: $(STAMP) ## where one worker's CPU goes in a join pass, sampled with py-spy (~2 min; installs py-spy)
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[profile]'
	$(BIN)/python -m bench.spy

superset-check: $(STAMP) ## Superset end to end: import the dashboards, compare chart numbers with the reports, screenshots
	scripts/superset_check.sh

schemas: $(STAMP) ## re-export the JSON Schema files from the pydantic models
	$(BIN)/gpuledger schemas export

clean: ## remove the venv and the demo data directory
	rm -rf $(VENV) .gpuledger build
