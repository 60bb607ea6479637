"""The in-process FP8-projection step A/B really toggles the path: on the torch reference
(GLM_RAY_FP8_PROJ_FORCE=1) every q_b_proj/o_proj is switched, its FP8 output differs from bf16 within
the FP8 bound, and both modes are timed."""
from __future__ import annotations

from glm_ray.bench import fp8_proj_step
from glm_ray.model.tiny import bundled_config


def test_step_ab_toggles_every_projection(tiny_dir, monkeypatch):
    monkeypatch.setenv("GLM_RAY_FP8_PROJ_FORCE", "1")
    (row,) = fp8_proj_step.run(tiny_dir, [600], seq_len=256, iters=1, dtype="bfloat16", device="cpu")
    # q_b_proj + o_proj of every decoder layer (the MTP layer's are built but not in the step)
    assert row["num_projections"] == 2 * bundled_config()["num_hidden_layers"]
    assert 1e-3 < row["proj_max_rel_err"] < 0.06               # FP8 numerics on, within the bound
    assert row["step_ms_on"] > 0 and row["step_ms_off"] > 0 and row["proj_ms_off"] > 0


def test_refuses_when_the_flag_is_a_no_op(tiny_dir, monkeypatch):
    monkeypatch.delenv("GLM_RAY_FP8_PROJ_FORCE", raising=False)
    import pytest
    with pytest.raises(SystemExit, match="not active"):
        fp8_proj_step.run(tiny_dir, [600], seq_len=256, iters=1, device="cpu")
