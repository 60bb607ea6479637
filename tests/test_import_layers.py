"""Dependencies point down: every `glm_ray` import in the package goes to the importing module's own
layer or a lower one, and function-level imports of glm_ray are the few deferred on purpose.

The order is written once, here (the README's architecture section draws it):
serve -> llm (offline API) -> engine -> worker -> model -> layers -> quant -> kernels -> distributed,
with the engine's wire contracts (the messages to the workers, SamplingParams, TokenDelta, errors; the
grammar runtime and the tokenizer loader, which the engine's validation and rank 0's sampler share) and
the plain bottom modules (configs, ForwardBatch, layer contracts, weight helpers, envs) below all of them.
Static: the source is parsed (AST), nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "glm_ray"

LAYERS: list[tuple[str, ...]] = [            # top to bottom
    ("glm_ray", "glm_ray.cli", "glm_ray.bench", "glm_ray.eval"),    # the package's own __init__ re-exports (LLM, SamplingParams)
    ("glm_ray.serve",),
    ("glm_ray.llm",),
    ("glm_ray.engine",),
    ("glm_ray.worker",),
    ("glm_ray.model",),
    ("glm_ray.layers",),
    ("glm_ray.quant",),
    ("glm_ray.kernels",),
    ("glm_ray.distributed",),
    ("glm_ray.engine.contract", "glm_ray.engine.sampling_params", "glm_ray.engine.outputs",
     "glm_ray.engine.errors", "glm_ray.engine.structured", "glm_ray.engine.tokenizer"),
    ("glm_ray.config", "glm_ray.forward_batch", "glm_ray.layer_contracts", "glm_ray.weights", "glm_ray.envs",
     "glm_ray.staging"),
]

# Function-level imports of glm_ray that stay, each deferred on purpose: (module, imported) -> why.
DEFERRED = {
    ("glm_ray", "glm_ray.llm"): "`import glm_ray` stays light: LLM pulls in ray (the executor)",
    ("glm_ray.worker.executor", "glm_ray.worker.worker_group"): "ray, only for TP > 1",
    ("glm_ray.worker.worker_group", "glm_ray.worker.worker"): "the model stack loads in each rank's actor, "
                                                              "not in the Router's process",
    ("glm_ray.bench.cli", "glm_ray.bench.client"): "aiohttp (the `bench` extra), only to run a benchmark",
    ("glm_ray.cli", "glm_ray.llm"): "ray (the executor), only for `glm-ray generate`",
    ("glm_ray.cli", "glm_ray.serve.app"): "ray, imported after `glm-ray serve` made its loopback setting",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.triton_kernels"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.mhc"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.kda"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.mla_decode"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.mla_prefill"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.indexer"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.routing"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.swiglu"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.fp32_linear"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.tma"): "triton's tensor descriptors: NVIDIA only, opt-in "
                                                               "(GLM_RAY_CUDA_MLA_PREFILL_TMA)",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.fp32_split"): "triton + tensor descriptors: NVIDIA only",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.fp8_small_m"): "triton, only on the cuda backend",
    ("glm_ray.bench.indexer", "glm_ray.kernels.cuda.indexer"): "triton: `--help` works without it",
    ("glm_ray.bench.indexer", "glm_ray.kernels.cuda.mla_prefill"): "triton: `--help` works without it",
    ("glm_ray.bench.prefill", "glm_ray.kernels.cuda.ops"): "the cuda backend's switch, set only on a GPU run",
    ("glm_ray.serve.engine_host", "glm_ray.worker.step_channel"): "TP > 1 only",
    ("glm_ray.bench.moe_decode", "glm_ray.kernels.cuda.moe_decode"): "triton: `--help` works without it",
    ("glm_ray.bench.moe_decode", "glm_ray.kernels.cuda.triton_kernels"): "triton: `--help` works without it",
    ("glm_ray.bench.moe_prefill", "glm_ray.kernels.cuda.moe_prefill"): "triton: `--help` works without it",
    ("glm_ray.bench.moe_prefill", "glm_ray.kernels.cuda.triton_kernels"): "triton: `--help` works without it",
    ("glm_ray.bench.kda", "glm_ray.kernels.cuda.kda"): "triton: `--help` works without it",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.moe_decode"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.moe_prefill"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.norm"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.cache_write"): "triton, only on the cuda backend",
    ("glm_ray.kernels.cuda.ops", "glm_ray.kernels.cuda.rope"): "triton, only on the cuda backend",
    ("glm_ray.worker.worker_group", "glm_ray.worker.step_channel"): "engine-in-rank-0 mode only",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rank(module: str) -> int:
    best, rank = -1, None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            sub = module.startswith(prefix + ".") and prefix != "glm_ray"     # the package root: itself only
            if (module == prefix or sub) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def _imports(path: Path):
    """(imported module, line, function-level?) for every glm_ray import of one file."""
    tree = ast.parse(path.read_text())
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    known = {_module_name(p) for p in ROOT.rglob("*.py")}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "glm_ray":
            for alias in node.names:            # `from glm_ray import kernels` imports a module
                sub = f"{node.module}.{alias.name}"
                yield (sub if sub in known else node.module), node.lineno, id(node) in in_function
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "glm_ray":
                    yield alias.name, node.lineno, id(node) in in_function


def _all():
    for path in sorted(ROOT.rglob("*.py")):
        src = _module_name(path)
        for target, line, fn_level in _imports(path):
            yield path, src, target, line, fn_level


def test_imports_point_down():
    upward = [f"{p.relative_to(ROOT.parent)}:{line}: {src} imports {tgt} (a higher layer)"
              for p, src, tgt, line, _ in _all() if _rank(tgt) < _rank(src)]
    assert not upward, "\n".join(upward)


def test_function_level_imports_are_only_the_deferred_ones():
    found = {(src, tgt): f"{p.relative_to(ROOT.parent)}:{line}" for p, src, tgt, line, fn in _all() if fn}
    extra = {k: v for k, v in found.items() if k not in DEFERRED}
    assert not extra, "function-level glm_ray imports (move them to the top, or add them to DEFERRED " \
                      "with the reason):\n" + "\n".join(f"{v}: {k[0]} -> {k[1]}" for k, v in sorted(extra.items()))
    stale = set(DEFERRED) - set(found)
    assert not stale, f"DEFERRED lists imports that no longer exist: {sorted(stale)}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The rank function is what the test relies on: a layer importing a higher one must rank lower."""
    assert _rank("glm_ray.quant.fp8") > _rank("glm_ray.layers.moe")
    assert _rank("glm_ray.engine.contract") > _rank("glm_ray.worker.model_runner") > _rank("glm_ray.engine.scheduler")
    assert _rank("glm_ray.engine.engine_core") < _rank("glm_ray.worker.worker")
