"""Start-up warm-up of the eager step paths (on a GPU), so their kernels compile before the first request.

A Triton kernel compiles on its first launch with a new specialization, and the eager paths of a step —
prefill, chunked prefill after a cached prefix, a mixed step, a decode row whose context passed the DSA
`index_topk` (the indexer's top-k selection instead of dense attention) — each launch kernels that pure
decode (captured in CUDA graphs at start-up) never does. Without a warm-up those compiles land inside the
first users' steps: seconds of TTFT. Here each rank runs, before graph capture, up to five eager forwards
shaped like those paths (the same sequence on every rank, so a TP group's collectives pair up):

1. a fresh prompt one block longer than `index_topk` (its last queries select: sparse prefill);
2. a one-block chunk after that prompt (a cached prefix); where the runner absorbs short chunks (its
   `absorb_tokens`: the backend's threshold or GLM_RAY_ABSORB_PREFILL_TOKENS) in both MLA forms (absorbed
   one-query rows, and the naive prefill a longer chunk takes), plus a chunk of that many rows (`warmup_steps`);
3. a mixed step: that sequence decoding one token (context past index_topk) beside a fresh one-block prompt;
4. fresh prompts of 8 and 16 blocks: mid-size prefills, whose rows per expert pick the grouped MoE's other
   tile classes (e.g. 512 tokens: 32 rows per expert at 64 experts x top-4; 1024: at 256 x top-8) and, from
   GLM_RAY_CUDA_MOE_PREFILL_ROWS (32) rows per expert, the block-FP8 prefill MoE kernels.

They write KV (and recurrent state) only to the first cache blocks and state rows, which no request holds
yet; nothing reads those contents before a request overwrites them. `GLM_RAY_KERNEL_WARMUP`: auto (on a GPU
only), on, off. A failure is logged and serving goes on: the warm-up is an optimization.
"""
from __future__ import annotations

import logging
import time

import torch

from glm_ray import envs
from glm_ray.forward_batch import build_forward_batch

logger = logging.getLogger(__name__)


def warmup_plan(index_topk: int | None, block_size: int, max_len: int, num_blocks: int) -> list[tuple]:
    """The steps as (query_lens, context_lens, block tables) over the first cache blocks; [] when the
    cache or max_len is too small for the first three (the mid-size prompts only where they fit)."""
    long = (index_topk or block_size) + block_size                   # past index_topk by one block
    long = min(long, max_len - block_size - 1)
    if long < 1:
        return []
    nb_a = -(-(long + block_size + 1) // block_size)                 # sequence A: prompt + chunk + 1 token
    if nb_a + 1 > num_blocks:
        return []
    a, b = list(range(nb_a)), [nb_a]                                  # block tables of A and B
    plan = [([long], [long], [a]),                                    # 1. fresh prompt
            ([block_size], [long + block_size], [a]),                 # 2. a chunk after a cached prefix
            ([1, block_size], [long + block_size + 1, block_size], [a, b])]   # 3. mixed: decode A + prompt B
    for nb_c in (8, 16):                                              # 4. mid-size fresh prompts (sequence C)
        if nb_c * block_size <= max_len and nb_a + 1 + nb_c <= num_blocks:
            n = nb_c * block_size
            plan.append(([n], [n], [list(range(nb_a + 1, nb_a + 1 + nb_c))]))
    return plan


def warmup_steps(plan: list[tuple], absorb_tokens: int, block_size: int, max_len: int,
                 num_blocks: int) -> list[tuple[tuple, int]]:
    """The plan's steps with the `absorb_tokens` each builds its batch with. Where short chunks over a cached
    context are absorbed (forward_batch._attention_units), the cached-prefix chunk runs in both MLA forms (the
    naive prefill a longer chunk takes, too), and a chunk of `absorb_tokens` rows over sequence A's prompt runs
    absorbed: many one-query rows take the decode kernels' wide-grid variants (the indexer's multi-tile
    programs, the unsplit MLA decode) that a served decode batch may never reach."""
    steps = [(step, absorb_tokens) for step in plan]
    if absorb_tokens > 1 and plan:
        long = plan[0][1][0]                                            # sequence A's prompt: the cached context
        steps.insert(2, (plan[1], 0))
        n = min(absorb_tokens, long)
        nb = -(-(long + n) // block_size)
        if long + n <= max_len and nb <= num_blocks and n > plan[1][0][0]:
            steps.insert(3, (([n], [long + n], [list(range(nb))]), absorb_tokens))
    return steps


def enabled(device: torch.device) -> bool:
    mode = envs.KERNEL_WARMUP.get()
    return mode == "on" or (mode == "auto" and device.type == "cuda")


@torch.inference_mode()
def warm_up(runner, num_blocks: int, max_len: int) -> int:
    """Run the plan's eager forwards (and logits) on `runner`'s model and caches; returns the steps run."""
    plan = warmup_plan(runner.model_cfg.index_topk if runner.model_cfg.has_indexer else None,
                       runner.block_size, max_len, num_blocks)
    if not plan:
        logger.info("kernel warm-up skipped: the KV cache or max_model_len is too small for it")
        return 0
    t0 = time.perf_counter()
    steps = warmup_steps(plan, runner.absorb_tokens, runner.block_size, max_len, num_blocks)
    for (qlens, clens, tables), absorb in steps:
        ids = (torch.arange(sum(qlens)) % 97 + 3).to(runner.device)                     # [T]
        batch = build_forward_batch(qlens, clens, tables, runner.block_size, runner.device, runner.cfg.mla_mode,
                                    list(range(len(qlens))), absorb)
        hidden = runner.model(ids, batch, runner.kv_caches, runner.index_caches, runner.state_caches)   # [T, D]
        ends = torch.tensor(qlens, device=runner.device).cumsum(0) - 1
        runner.model.compute_logits(hidden[ends])                                        # [B, V]
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("kernel warm-up: %d eager steps in %.1f s", len(steps), time.perf_counter() - t0)
    return len(steps)
