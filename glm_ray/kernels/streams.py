"""The second CUDA stream a decode-sized layer forks independent work onto, and which "lane" (main or
side) the running code is on. One side stream per device, created on first use outside graph capture
(the warm-up steps run eagerly first). Layers ask `side_stream_for(x, limit)`, run the forked work under
`forked(stream)` and `join(stream)` before reading it; kernels that keep per-launch device state
(fp8_small_m's arrival counters) key it by `lane()`, so launches that may run concurrently never share it.
Owned here, below both the layers and the kernels, so neither needs a device check of its own.

Why: at decode sizes every kernel of a layer is small (a few us, part of the SMs), so two independent
chains — an MoE layer's shared experts and its router + routed experts — finish sooner side by side than
one after the other (sglang's alt_stream). Under CUDA-graph capture the fork (`side.wait_stream(main)`)
and the join (`main.wait_stream(side)`) become graph edges, so the replayed graph keeps the overlap.
Memory safety comes from the join: the main stream reads the side chain's output only after it, and
the side stream's next use (the next layer's fork) waits on the main stream first, so no buffer is
reused while the other stream may still touch it.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}
_LANE = threading.local()
LANES = (0, 1)                                          # main, side


def side_stream_for(x: torch.Tensor, limit: int) -> torch.cuda.Stream | None:
    """The side stream for work on x's device when x has 1..limit rows and lives on a GPU, else None."""
    if not x.is_cuda or not 0 < x.shape[0] <= limit:
        return None
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(idx)
    if stream is None:
        if torch.cuda.is_current_stream_capturing():      # never create one inside a capture
            return None
        stream = _STREAMS[idx] = torch.cuda.Stream(device=idx)
    return stream


@contextmanager
def on_side(stream: torch.cuda.Stream):
    """Run the block's launches on `stream` as the side lane (the caller forks and joins)."""
    prev = getattr(_LANE, "value", 0)
    _LANE.value = 1
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        _LANE.value = prev


@contextmanager
def forked(side: torch.cuda.Stream):
    """Fork the block onto the side lane: `side` first waits for everything the main (current) stream
    has queued, then the block's launches go to it. The caller calls `join(side)` before the main stream
    reads what the block wrote."""
    side.wait_stream(torch.cuda.current_stream(side.device))
    with on_side(side):
        yield


def join(side: torch.cuda.Stream) -> None:
    """The main (current) stream waits for everything queued on `side` (the fork's outputs are ready)."""
    torch.cuda.current_stream(side.device).wait_stream(side)


def lane() -> int:
    """0 on the main lane (whatever stream it runs on: the default one, a graph's capture stream), 1 inside
    `on_side`."""
    return getattr(_LANE, "value", 0)


__all__ = ["LANES", "forked", "join", "lane", "on_side", "side_stream_for"]
