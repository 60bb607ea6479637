"""`glm-ray` command line: serve | generate | make-tiny | bench."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: the cached tiny GLM-5)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights + activations + KV cache (KV gets what is left)")
    p.add_argument("--fp8-proj-gemm", action="store_true", default=None,
                   help="prefill-only FP8 GEMM for MLA q_b_proj/o_proj (also GLM_RAY_FP8_PROJ_GEMM=1)")
    p.add_argument("--fp8-proj-min-tokens", type=int, default=512,
                   help="with --fp8-proj-gemm: forward batches of more than this many tokens take the FP8 GEMM "
                        "(H200 step A/B: FP8 pays from ~1-2k tokens at GLM-5 shapes, only above 4096 at glm5-flash-31b's)")


def cmd_make_tiny(a) -> int:
    from glm_ray.model.tiny import bundled_config, write_tiny
    cfg = bundled_config(a.config) if a.config and not os.path.isfile(a.config) else None
    if a.config and os.path.isfile(a.config):
        with open(a.config) as f:
            cfg = json.load(f)
    if a.quant == "bf16":
        out = write_tiny(a.dir, cfg, seed=a.seed)
    else:
        from glm_ray.model.quantize import make_tiny_quantized
        out = make_tiny_quantized(a.dir, a.quant, cfg, seed=a.seed)
    print(f"wrote {out}")
    return 0


def cmd_generate(a) -> int:
    from glm_ray import LLM, SamplingParams
    llm = LLM(a.model, tensor_parallel_size=a.tp, device=a.device, dtype=a.dtype, load_format=a.load_format,
              kernel_backend=a.kernel_backend, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
              block_size=a.block_size, gpu_memory_utilization=a.gpu_memory_utilization,
              fp8_proj_gemm=a.fp8_proj_gemm, fp8_proj_min_tokens=a.fp8_proj_min_tokens)
    tok = llm.get_tokenizer()
    prompts = a.prompt or ["Hello, my name is"]
    if a.chat and tok is not None:
        prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}],
                                                                add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)} for p in prompts]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                        seed=a.seed, ignore_eos=a.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = 0
    for o in outs:
        c = o.outputs[0]
        n += len(c.token_ids)
        shown = o.prompt if o.prompt is not None else f"<{len(o.prompt_token_ids)} tokens>"
        print(f"prompt: {shown!r}\noutput: {c.text!r}  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    print(f"{n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)")
    return 0


def cmd_serve(a) -> int:
    import ray
    from ray import serve
    from glm_ray.serve.app import build_app
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    args = {"model": a.model or "tiny", "tp": a.tp, "device": a.device, "dtype": a.dtype,
            "load_format": a.load_format, "kernel_backend": a.kernel_backend, "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens, "max_model_len": a.max_model_len,
            "block_size": a.block_size, "gpu_memory_utilization": a.gpu_memory_utilization,
            "fp8_proj_min_tokens": a.fp8_proj_min_tokens}
    if a.fp8_proj_gemm is not None:
        args["fp8_proj_gemm"] = True
    if a.served_model_name:
        args["served_model_name"] = a.served_model_name
    if args["model"] == "tiny":            # write the cache once here, not in two replicas at once
        from glm_ray.model.tiny import default_tiny_model
        default_tiny_model()
    ray.init(address=a.address or "local", include_dashboard=False, _metrics_export_port=a.metrics_port,
             num_cpus=a.num_cpus, _node_ip_address=a.host if a.host in ("127.0.0.1", "localhost") else None)
    serve.start(http_options={"host": a.host, "port": a.port})
    serve.run(build_app(args), name="glm-ray", route_prefix="/", blocking=False)
    print(f"\nglm-ray is serving {args['model']!r} (tp={a.tp})\n"
          f"  OpenAI API : http://{a.host}:{a.port}/v1   (e.g. curl http://{a.host}:{a.port}/v1/models)\n"
          f"  metrics    : http://{a.host}:{a.metrics_port}/metrics   (grep glm_ray)\n"
          f"Ctrl-C to stop.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm-ray", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="start a local Ray + the OpenAI-compatible app")
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8080)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--address", default=None, help="join an existing Ray cluster instead of starting one")
    p.add_argument("--num-cpus", type=int, default=None)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="offline generation with the LLM API")
    _add_engine_args(p)
    p.add_argument("--prompt", action="append", help="repeatable")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("make-tiny", help="write a tiny random GLM-5 checkpoint in the real on-disk format")
    p.add_argument("dir")
    p.add_argument("--config", default=None, help="a config.json path or a bundled config name (glm5-tiny.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", default="bf16", choices=["bf16", "fp8", "mxfp4"],
                   help="fp8: DeepSeek-style block FP8; mxfp4: Quark MXFP4 experts + block-FP8 MTP layer")
    p.set_defaults(func=cmd_make_tiny)

    from glm_ray.model import quantize
    quantize.add_parser(sub)

    from glm_ray.bench import cli as bench_cli
    bench_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("GLM_RAY_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = build_parser().parse_args(argv)
    return a.func(a) or 0


if __name__ == "__main__":
    sys.exit(main())
