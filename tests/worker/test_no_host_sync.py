"""No host sync in a decode forward, checked on the CPU: every torch call of the model's decode forward
runs under a TorchFunctionMode that records the calls which, on a GPU, read device memory back to the
host (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, bool-mask indexing, `bincount`, `unique`,
`repeat_interleave` without `output_size`, copies to the CPU). One would stall every eager step and
break CUDA-graph capture (tests/gpu/test_cuda_graphs.py checks the same on the H200 with torch's
sync debug mode). Both the graphs' static batches (dense and sparse DSA capacities) and an eagerly
built decode batch are checked, for GLM-5 and GLM-5.3-Flash."""
from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from glm_ray.forward_batch import build_forward_batch
from glm_ray.llm import LLM
from glm_ray.worker import model_runner

_SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
            "masked_select", "bincount", "unique", "unique_consecutive", "cpu", "numpy"}


class HostSyncRecorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        bad = name in _SYNCING
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            idx = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
            bad = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                      torch.Tensor):
            bad = kwargs.get("output_size") is None
        if name == "where" and len(args) + len(kwargs) == 1:
            bad = True
        if name in ("to", "copy_") and any(getattr(a, "type", None) == "cpu" or a == "cpu" for a in args[1:]):
            bad = True
        if bad:
            where = [f for f in traceback.extract_stack()[:-1] if "glm_ray" in f.filename]
            self.calls.append(f"{name} at {where[-1].filename.split('glm_ray/')[-1]}:{where[-1].lineno}"
                              if where else name)
        return func(*args, **kwargs)


def _runner(path, monkeypatch):
    monkeypatch.setattr(model_runner, "graphs_enabled", lambda cfg, device: True)
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_model_len=256)
    return llm.engine.executor.worker.runner


def _check(fn):
    rec = HostSyncRecorder()
    with torch.inference_mode(), rec:
        fn()
    assert not rec.calls, rec.calls


def test_recorder_sees_syncs():
    rec = HostSyncRecorder()
    x = torch.arange(4)
    with rec:
        x.sum().item()
        x[x > 1]
        torch.bincount(x)
    assert len(rec.calls) == 3


@pytest.mark.parametrize("model", ["glm5", "glm53"])
def test_decode_forward_has_no_host_sync(model, oracle_dir, tmp_path_factory, monkeypatch):
    if model == "glm5":
        path = oracle_dir
    else:
        from tests.flash_tiny import available, write_flash_tiny  # noqa: PLC0415
        if not available():
            pytest.skip("transformers without glm5_next")
        path = write_flash_tiny(tmp_path_factory.mktemp("g53sync") / "tiny")
    r = _runner(path, monkeypatch)
    g = r.graphs
    g._fill_padding(0, g.buckets[-1])
    assert len(g.capacities) >= 2 or model == "glm53"            # dense and sparse DSA capacities
    for B in (1, g.buckets[-1]):
        for cap in g.capacities:
            _check(lambda: g._forward(B, g._batch(B, cap)))
    # an eagerly built decode batch, contexts past index_topk (sparse)
    bs = r.block_size
    tables = [[i * 3, i * 3 + 1, i * 3 + 2] for i in range(3)]
    batch = build_forward_batch([1, 1, 1], [3 * bs, 2 * bs, bs + 3], tables, bs, r.device)
    ids = torch.tensor([11, 12, 13])
    _check(lambda: r.model(ids, batch, r.kv_caches, r.index_caches, r.state_caches))
