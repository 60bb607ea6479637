"""`glm-ray bench` argument handling: the subcommand hook for the parent CLI, defaults, bad input."""
import argparse
import math

from glm_ray.bench import cli


def test_add_parser_hooks_into_a_parent_cli():
    parent = argparse.ArgumentParser(prog="glm-ray")
    sub = parent.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parent.parse_args(["bench", "--base-url", "http://h:1", "--concurrency", "4", "8", "--label", "fp8_proj=on"])
    assert args.command == "bench" and args.func is cli.run
    assert args.base_url == "http://h:1" and args.concurrency == [4, 8] and args.label == "fp8_proj=on"


def test_defaults_follow_the_benchmark_protocol():
    args = cli.build_parser().parse_args([])
    assert args.concurrency == [4, 8, 16, 32, 64]          # sweep
    assert args.prompts_per_concurrency == 4 and args.num_prompts is None   # N = 4C
    assert args.input_len == 1024 and args.output_len == 1024 and args.range_ratio == 1.0
    assert math.isinf(args.request_rate) and args.warmup_requests == 1
    assert cli.build_parser().parse_args(["--request-rate", "2.5"]).request_rate == 2.5
    assert cli.build_parser().parse_args(["--exclude-token-ids", "1,2, 3"]).exclude_token_ids == [1, 2, 3]


def test_bad_arguments_exit_2(capsys):
    assert cli.main(["--range-ratio", "1.5", "--base-url", "http://127.0.0.1:9"]) == 2
    assert cli.main(["--extra-body", "[1]", "--base-url", "http://127.0.0.1:9"]) == 2
    assert cli.main(["--base-url", "http://127.0.0.1:9", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--range-ratio" in err and "--extra-body" in err and "cannot reach server" in err
