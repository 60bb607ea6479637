"""Host -> device copies of a step's small inputs that never wait for the GPU.

A pageable host -> device copy goes through the driver's own staging and can hold the host until the
stream reaches it, so under async scheduling — the host preparing step N+1 while the GPU runs step N — a
`torch.tensor(list).to(cuda)` can stall the host until step N ends (and so can a dtype-converting copy
from pinned memory: torch converts into a pageable temporary first). Both helpers here go through pinned memory with an
asynchronous copy; `stage` also packs many arrays into one copy.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a device tensor without a host sync: through pinned memory with an
    asynchronous copy on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.float32): torch.float32}


# Every staged array starts on a 256-byte boundary, as the CUDA caching allocator's own blocks do: Triton
# specializes a kernel on whether each pointer argument is 16-byte aligned (and TMA needs it), so a view at
# an odd offset would compile another variant of every kernel it reaches, at run time.
ALIGN = 256


def stage(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Many small host arrays -> tensors on `device` with one copy: packed at `ALIGN`-byte offsets
    into one byte buffer (pinned on CUDA, from torch's caching host allocator, which keeps a block
    until the copy that read it has run), copied asynchronously, viewed back per array on the device
    (int64 / int32 / bool / float32; no kernel per array). On the CPU the views share the host buffer."""
    offs, n = [], 0
    for a in arrays:
        offs.append(n)
        n += -(-a.nbytes // ALIGN) * ALIGN
    buf = torch.empty(max(n, 8), dtype=torch.uint8, pin_memory=device.type == "cuda")
    view = buf.numpy()
    for a, o in zip(arrays, offs):
        view[o:o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    if device.type != "cpu":
        buf = buf.to(device, non_blocking=True)
    return [buf[o:o + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, o in zip(arrays, offs)]


__all__ = ["ALIGN", "stage", "to_device"]
