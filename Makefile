# Everything a fresh machine needs, idempotent. `make serve` = the main job, `make test` = the suite.
# `make` alone lists the targets.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build on these machines; on a GPU box set TORCH_SPEC to the matching CUDA/ROCm torch.
TORCH_SPEC ?= torch==2.13.0
# sudo for apt-get unless we are root
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.DEFAULT_GOAL := help
.PHONY: help setup setup-test serve test lint bench-cpu clean

help:
	@echo "make serve [ARGS='...']   venv + glm-ray (first run ~3.5 min, ~1.9 GB in $(VENV)), then"
	@echo "                          'glm-ray serve ARGS' on http://127.0.0.1:8000/v1 (Ctrl-C stops it)"
	@echo "                          e.g. make serve ARGS='--port 9000 --max-num-seqs 8'"
	@echo "make test [PYTEST_ARGS='...']  + test deps ($(VENV) ~2.8 GB in all), curl, promtool; the suite (~5 min)"
	@echo "make lint                 ruff check . (CI runs it before the tests)"
	@echo "make setup / setup-test   only install;  make bench-cpu [ARGS=...]  offline engine benchmark"
	@echo "make clean                remove $(VENV)"
	@echo "Afterwards: source $(VENV)/bin/activate (or call $(VENV)/bin/glm-ray, serve, ray directly)."

$(VENV)/.installed: pyproject.toml
	@echo ">> installing torch + glm-ray into $(VENV) (first time: ~3.5 min, ~1.9 GB)"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	@command -v curl >/dev/null || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq --no-install-recommends curl; }
	@{ command -v promtool && command -v prometheus; } >/dev/null || $(MAKE) --no-print-directory $(VENV)/bin/promtool
	touch $@

# promtool + prometheus (tests/deploy) from Debian's package, unpacked into $(VENV)/bin: nothing is
# installed system-wide, so no prometheus service is set up, enabled or started.
$(VENV)/bin/promtool:
	@set -e; tmp=$$(mktemp -d); chmod 755 $$tmp; trap 'rm -rf $$tmp' EXIT; \
	  apt-cache show prometheus >/dev/null 2>&1 || $(SUDO) apt-get update -qq; \
	  (cd $$tmp && apt-get download -qq -o APT::Sandbox::User=$$(id -un) prometheus); \
	  dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/root; \
	  cp $$tmp/root/usr/bin/prometheus $$tmp/root/usr/bin/promtool $(VENV)/bin/; \
	  echo ">> $$($(VENV)/bin/promtool --version 2>&1 | head -1) -> $(VENV)/bin"

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

serve: setup
	$(VENV)/bin/glm-ray serve $(ARGS)

test: setup-test
	PATH=$(abspath $(VENV))/bin:$$PATH RAY_AUTH_MODE=disabled $(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup-test
	$(VENV)/bin/ruff check .

bench-cpu: setup
	$(PY) -m glm_ray.bench.offline $(ARGS)

clean:
	rm -rf $(VENV)
