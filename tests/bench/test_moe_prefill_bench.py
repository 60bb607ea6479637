"""`python -m glm_ray.bench.moe_prefill` (old vs new grouped MoE at prefill sizes, the GPU tile sweep): its config
syntax, the override it installs for the duration of one timing (and removes after, also on an error), that a
bad config fails before any GPU work, and (interpreted, tiny shapes) that the functions it times compute the
MoE. The timings themselves need a GPU."""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")           # CPU-only: the kernels run interpreted

from glm_ray.bench import moe_prefill
from glm_ray.kernels.cuda.layout import TileConfig, moe_configs
from tests.kernels.cases import moe_case, rel_err


def test_parse_config():
    assert moe_prefill.parse_config("default") is None
    c1, c2 = moe_prefill.parse_config("64:128:64:128:8:4:3")
    assert c1 == TileConfig(64, 128, 128, 8, 3) and c2 == TileConfig(64, 64, 128, 4, 3)
    c1, c2 = moe_prefill.parse_config("64:256:128:128:8:8:3:tma")
    assert c1 == TileConfig(64, 256, 128, 8, 3, tma=True) and c2 == TileConfig(64, 128, 128, 8, 3, tma=True)
    c1, c2 = moe_prefill.parse_config("64:256:128:128:8:8:2:tma:r128")
    assert c1 == TileConfig(64, 256, 128, 8, 2, tma=True, maxnreg=128) and c2.maxnreg == 128 and c2.tma
    assert moe_prefill.parse_config("64:256:128:128:8:8:2:r96")[0] == TileConfig(64, 256, 128, 8, 2, maxnreg=96)
    c1, c2 = moe_prefill.parse_config("64:256:128:128:8:8:3:tma:p1")
    assert c1 == TileConfig(64, 256, 128, 8, 3, tma=True, persistent=1) and c2.persistent == 1 and c2.tma
    for bad in ("64:128", "a:b:c:d:e:f:g", "64:128:64:128:8:4:3:1", "64:128:64:128:8:4:3:r", "64:128:64:128:8:4:3:tma:tma",
                "64:128:64:128:8:4:3:r64:r96", "64:128:64:128:8:4:3:p0", "64:128:64:128:8:4:3:p1:p2"):
        with pytest.raises(Exception, match="BM:BN1:BN2"):
            moe_prefill.parse_config(bad)


def test_tiles_override_is_scoped():
    tk = types.SimpleNamespace(moe_configs=moe_configs)
    cfgs = moe_prefill.parse_config("32:128:64:128:4:4:4")
    with moe_prefill.tiles(tk, cfgs):
        assert tk.moe_configs("fp8", 8192, 64) == cfgs
    assert tk.moe_configs is moe_configs
    with pytest.raises(RuntimeError), moe_prefill.tiles(tk, cfgs):
        raise RuntimeError("a rejected config")
    assert tk.moe_configs is moe_configs
    with moe_prefill.tiles(tk, None):                 # default: the heuristic itself
        assert tk.moe_configs is moe_configs


def test_bad_config_fails_before_the_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        moe_prefill.main(["--configs", "64:128"])
    assert e.value.code == 2 and "BM:BN1:BN2" in capsys.readouterr().err


def test_timed_functions_compute_the_moe():
    """Both paths' whole call and each launch `--stages` times alone, on tiny shapes under the interpreter."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton interpreted (CPU)")
    tk, mp = moe_prefill.moe_modules()
    if not tk.INTERPRET:
        pytest.skip("triton_kernels was imported in compiled mode")
    c = moe_case(20, 256, 256, 4, 2, "fp8", dtype=torch.float32, x_scale=2.0)
    args = (tk, mp, c.x, c.w13, c.s13, c.w2, c.s2, c.topk_weights, c.topk_ids)
    new_cfg = moe_prefill.parse_config("16:256:128:128:4:4:2")
    old = moe_prefill.call("old", *args, "fp8", moe_prefill.parse_config("16:128:128:128:4:4:2"))()
    new = moe_prefill.call("new", *args, "fp8", new_cfg)()
    assert rel_err(new, old) <= 1e-5
    capped = moe_prefill.call("new", *args, "fp8", moe_prefill.parse_config("16:256:128:128:4:4:2:r128"))()
    assert torch.equal(capped, new)                   # a register cap is a compile option: the same math
    with pytest.raises(ValueError, match="FP8 only"):
        moe_prefill.call("new", *args, "bf16", None)
    for path, cfgs in (("old", None), ("new", new_cfg)):
        fns = moe_prefill.stage_fns(path, *args, cfgs)
        assert list(fns) == ["quant", "up", "down", "comb"]
        outs = {name: fn() for name, fn in fns.items()}
        assert rel_err(outs["comb"], old) <= 1e-5                  # the launches in order = the whole call
