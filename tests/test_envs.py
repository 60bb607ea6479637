"""glm_ray/envs.py is the one list of GLM_RAY_* variables: every name the package uses is declared
there, the README's table is generated from it, and a bad value is an error that names the variable."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from glm_ray import envs

ROOT = Path(__file__).resolve().parents[1]


def test_every_variable_used_is_declared():
    declared = {v.name for v in envs.ALL}
    used = set()
    for path in (ROOT / "glm_ray").rglob("*.py"):
        used |= set(re.findall(r"\bGLM_RAY_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert used - declared == set(), f"used but not declared in glm_ray/envs.py: {sorted(used - declared)}"
    assert declared - used <= {v.name for v in envs.ALL}


def test_readme_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    assert envs.table() in readme, "README's environment table is stale: paste `python -c 'from glm_ray " \
                                   "import envs; print(envs.table())'`"


@pytest.mark.parametrize("var,raw", [(envs.CPU_THREADS, "0"), (envs.CPU_THREADS, "two"),
                                     (envs.FP8_PROJ_GEMM, "maybe"), (envs.ORCHESTRATION, "fast"),
                                     (envs.LOG_LEVEL, "LOUD")])
def test_bad_values_name_the_variable(monkeypatch, var, raw):
    monkeypatch.setenv(var.name, raw)
    with pytest.raises(ValueError, match=var.name):
        var.get()


def test_values_parse(monkeypatch):
    monkeypatch.setenv(envs.CPU_THREADS.name, "3")
    monkeypatch.setenv(envs.TORCH_OPS.name, "fused_moe, mhc_coefficients,")
    monkeypatch.setenv(envs.FP8_PROJ_GEMM.name, "ON")
    assert envs.CPU_THREADS.get() == 3 and envs.FP8_PROJ_GEMM.get() is True
    assert envs.TORCH_OPS.get() == {"fused_moe", "mhc_coefficients"}
    monkeypatch.delenv(envs.CPU_THREADS.name)
    assert envs.CPU_THREADS.get() is None
