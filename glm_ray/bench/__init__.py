"""Serving benchmark comparable with sglang.bench_serving (`glm-ray bench`).

Modules: `metrics` (metric definitions, pure), `datasets` (the requests: random ids, ShareGPT,
generated shared prefixes), `client` (load generation and streaming timings),
`report` (JSONL, tables, compare, plots), `cli` (the ``bench`` subcommand).
"""
