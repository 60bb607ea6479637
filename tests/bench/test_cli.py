"""`glm-ray bench` argument handling: the subcommand hook for the parent CLI, the sglang.bench_serving /
`vllm bench serve` flags (each parsed to the setting it means there, checked on the resulting
BenchConfig), our older names as aliases of the same settings, defaults, bad input."""
import argparse
import dataclasses
import math

import pytest

from glm_ray.bench import cli


def config(argv):
    cfg, _ = cli.build_config(cli.build_parser().parse_args(argv))
    return cfg


def test_add_parser_hooks_into_a_parent_cli():
    parent = argparse.ArgumentParser(prog="glm-ray")
    sub = parent.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parent.parse_args(["bench", "--base-url", "http://h:1", "--concurrency", "4", "8", "--label", "fp8_proj=on"])
    assert args.command == "bench" and args.func is cli.run
    assert args.base_url == "http://h:1" and args.max_concurrency == [4, 8] and args.label == "fp8_proj=on"


# (flags as copied from an sglang / vLLM command, {BenchConfig field: value it must mean})
SGLANG_VLLM_FLAGS = [
    (["--backend", "sglang"], {"api": "completions", "endpoint": "/v1/completions", "backend": "sglang"}),
    (["--backend", "sglang-oai"], {"api": "completions", "endpoint": "/v1/completions"}),
    (["--backend", "vllm"], {"api": "completions", "endpoint": "/v1/completions", "backend": "vllm"}),
    (["--backend", "openai"], {"api": "completions", "endpoint": "/v1/completions"}),
    (["--backend", "openai-chat"], {"api": "chat", "endpoint": "/v1/chat/completions"}),
    (["--backend", "sglang-oai-chat"], {"api": "chat", "endpoint": "/v1/chat/completions"}),
    (["--backend", "vllm-chat"], {"api": "chat", "endpoint": "/v1/chat/completions"}),
    (["--backend", "openai-chat", "--endpoint", "/chat"], {"api": "chat", "endpoint": "/chat"}),
    (["--base-url", "http://10.1.2.3:30000"], {"base_url": "http://10.1.2.3:30000"}),
    (["--host", "10.1.2.3", "--port", "30000"], {"base_url": "http://10.1.2.3:30000"}),
    (["--model", "glm-5"], {"model": "glm-5"}),
    (["--model", "/models/GLM-5", "--served-model-name", "glm-5"], {"model": "glm-5"}),
    (["--tokenizer", "/models/GLM-5"], {"tokenizer": "/models/GLM-5"}),
    (["--dataset-name", "random"], {"dataset": "random"}),
    (["--dataset-name", "random-ids"], {"dataset": "random"}),
    (["--dataset-name", "sharegpt", "--dataset-path", "/d/sg.json"], {"dataset": "sharegpt", "dataset_path": "/d/sg.json"}),
    (["--dataset-name", "generated-shared-prefix"], {"dataset": "generated-shared-prefix"}),
    (["--random-input-len", "32"], {"input_len": 32}),
    (["--random-output-len", "8"], {"output_len": 8}),
    (["--random-range-ratio", "0.5"], {"range_ratio": 0.5}),
    (["--random-prefix-len", "5"], {"random_prefix_len": 5}),
    (["--num-prompts", "8"], {"num_prompts": 8}),
    (["--request-rate", "4"], {"request_rate": 4.0}),
    (["--request-rate", "inf"], {"request_rate": math.inf}),
    (["--max-concurrency", "4"], {"concurrencies": (4,)}),
    (["--seed", "7"], {"seed": 7}),
    (["--disable-ignore-eos"], {"ignore_eos": False}),
    (["--ignore-eos"], {"ignore_eos": True}),
    (["--disable-stream"], {"stream": False}),
    (["--sharegpt-output-len", "16"], {"sharegpt_output_len": 16}),
    (["--sharegpt-context-len", "100"], {"sharegpt_context_len": 100}),
    (["--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40",
      "--gsp-question-len", "5", "--gsp-output-len", "7", "--gsp-range-ratio", "0.5"],
     {"gsp_num_groups": 2, "gsp_prompts_per_group": 3, "gsp_system_prompt_len": 40, "gsp_question_len": 5,
      "gsp_output_len": 7, "gsp_range_ratio": 0.5}),
    (["--extra-request-body", '{"top_k": 1}'], {"extra_body": {"top_k": 1}}),
    (["--warmup-requests", "0"], {"warmup_requests": 0}),
    (["--disable-tqdm"], {"show_progress": False}),
    (["--tag", "run-a"], {"label": "run-a"}),
]


@pytest.mark.parametrize("argv, meaning", SGLANG_VLLM_FLAGS, ids=[" ".join(a) for a, _ in SGLANG_VLLM_FLAGS])
def test_sglang_and_vllm_flags_mean_what_they_mean_there(argv, meaning):
    cfg = config(argv)
    assert {k: getattr(cfg, k) for k in meaning} == meaning


def test_output_flags():
    a = cli.build_parser().parse_args(["--output-file", "o.jsonl", "--output-details"])
    assert a.output_file == "o.jsonl" and a.output_details
    assert cli.build_parser().parse_args(["--result-file", "r.jsonl"]).output_file == "r.jsonl"


def test_defaults_are_sglangs():
    cfg = config([])
    assert cfg.base_url == "http://127.0.0.1:8000" and cfg.endpoint == "/v1/completions" and cfg.api == "completions"
    assert cfg.dataset == "random" and cfg.num_prompts == 1000 and cfg.concurrencies == (None,)
    assert cfg.input_len == 1024 and cfg.output_len == 1024 and cfg.range_ratio == 0.0 and cfg.random_prefix_len == 0
    assert cfg.seed == 1 and math.isinf(cfg.request_rate) and cfg.ignore_eos and cfg.stream
    assert (cfg.gsp_num_groups, cfg.gsp_prompts_per_group, cfg.gsp_system_prompt_len, cfg.gsp_question_len,
            cfg.gsp_output_len, cfg.gsp_range_ratio) == (64, 16, 2048, 128, 256, 1.0)
    assert cfg.sharegpt_output_len is None and cfg.sharegpt_context_len is None and cfg.tokenizer is None
    assert cfg.warmup_requests == 1 and cfg.repetitions == 1 and cfg.extra_body == {}
    assert cfg.prompts_for(None) == 1000
    assert config(["--dataset-name", "generated-shared-prefix"]).prompts_for(None) == 64 * 16


def test_old_names_are_aliases_of_the_same_settings():
    old = config(["--input-len", "64", "--output-len", "16", "--range-ratio", "1", "--concurrency", "4", "8",
                  "--label", "x", "--extra-body", '{"a": 1}', "--no-progress"])
    new = config(["--random-input-len", "64", "--random-output-len", "16", "--random-range-ratio", "1",
                  "--max-concurrency", "4", "8", "--tag", "x", "--extra-request-body", '{"a": 1}', "--disable-tqdm"])
    assert dataclasses.asdict(old) == dataclasses.asdict(new)
    assert old.input_len == 64 and old.range_ratio == 1.0 and old.concurrencies == (4, 8) and old.label == "x"


def test_sweep_prompts():
    # a sweep without --num-prompts keeps origin PR B's N = 4 x C; a single point gets sglang's 1000
    cfg = config(["--concurrency", "4", "8", "16", "32", "64"])
    assert cfg.num_prompts is None and [cfg.prompts_for(c) for c in cfg.concurrencies] == [16, 32, 64, 128, 256]
    assert config(["--max-concurrency", "8"]).prompts_for(8) == 1000
    cfg = config(["--max-concurrency", "4", "8", "--prompts-per-concurrency", "2"])
    assert [cfg.prompts_for(c) for c in cfg.concurrencies] == [8, 16]
    cfg = config(["--max-concurrency", "4", "8", "--num-prompts", "16"])
    assert [cfg.prompts_for(c) for c in cfg.concurrencies] == [16, 16]
    cfg, notes = cli.build_config(cli.build_parser().parse_args(
        ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
         "--num-prompts", "100"]))
    assert cfg.prompts_for(None) == 6 and "not used by generated-shared-prefix" in notes[0]


@pytest.mark.parametrize("argv, message", [
    (["--range-ratio", "1.5"], "--range-ratio"),
    (["--random-range-ratio", "-0.1"], "--random-range-ratio"),
    (["--gsp-range-ratio", "2"], "--gsp-range-ratio"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--prompts-per-concurrency", "4"], "needs --max-concurrency"),
    (["--dataset-name", "sharegpt", "--dataset-path", "x.json", "--sharegpt-output-len", "3"], ">= 4"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    assert cli.main(argv + ["--base-url", "http://127.0.0.1:9"]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_exits_2(capsys):
    assert cli.main(["--base-url", "http://127.0.0.1:9", "--no-progress"]) == 2
    assert "cannot reach server" in capsys.readouterr().err
