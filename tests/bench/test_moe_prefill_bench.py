"""`python -m glm_ray.bench.moe_prefill` (the GPU tile sweep of the grouped MoE at prefill sizes): its config
syntax, the override it installs for the duration of one timing (and removes after, also on an error), and
that a bad config fails before any GPU work. The timings themselves need a GPU."""
from __future__ import annotations

import types

import pytest

from glm_ray.bench import moe_prefill
from glm_ray.kernels.cuda.layout import TileConfig, moe_configs


def test_parse_config():
    assert moe_prefill.parse_config("default") is None
    c1, c2 = moe_prefill.parse_config("64:128:64:128:8:4:3")
    assert c1 == TileConfig(64, 128, 128, 8, 3) and c2 == TileConfig(64, 64, 128, 4, 3)
    for bad in ("64:128", "a:b:c:d:e:f:g", "64:128:64:128:8:4:3:1"):
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
