# Everything a fresh machine needs, idempotent. `make serve` = the main job, `make test` = the suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build on these machines; on a GPU box set TORCH_SPEC to the matching CUDA/ROCm torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup setup-test serve test bench-cpu clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	@command -v promtool >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

serve: setup
	$(VENV)/bin/glm-ray serve $(ARGS)

test: setup-test
	PATH=$(abspath $(VENV))/bin:$$PATH RAY_AUTH_MODE=disabled $(PY) -m pytest -q $(PYTEST_ARGS)

bench-cpu: setup
	$(PY) -m glm_ray.bench.offline $(ARGS)

clean:
	rm -rf $(VENV)
