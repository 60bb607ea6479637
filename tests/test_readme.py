"""The README is tested: what a new user copies from it must work as written.

Every shell command in README.md's code blocks (```bash / sh / shell / console) and in the header
comment of deploy/serve_config.yaml is checked without running it:
  - `glm-ray ...`          parses with glm-ray's own argparse parser; `glm-ray serve` flags also pass
                           ServeArgs (the app arguments they become);
  - `serve ...`, `ray ...` parse with Ray's own click commands; `serve run/deploy IMPORT k=v ...`
                           imports the app builder and parses the `k=v` strings with ServeArgs exactly
                           as `serve run` hands them over (every value a string); a config file exists
                           and its glm-ray apps pass ServeArgs;
  - `make TARGET [ARGS=..]` names a Makefile target; `make serve ARGS=...` parses as `glm-ray serve`;
  - `python -m glm_ray.X`  parses with that module's own parser (its `main` stops right after parsing);
  - anything else must be a program on the known list below (helm, kubectl, ...), so a new kind of
    command is a decision, not a silent pass.
The `curl` examples are then run, as written, against the tiny app the test session deploys
(http://127.0.0.1:8000 and :8080 rewritten to that app's HTTP and metrics ports).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# programs the README may show that this test does not check (not ours, or not parseable offline)
UNCHECKED = {"helm", "kubectl", "docker", "kustomize", "git", "cd", "source", "export", "pip",
             "grep", "less", "head", "tail", "jq"}     # the last ones filter a piped curl's output
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
README_HTTP = "http://127.0.0.1:8000"
README_METRICS = "http://127.0.0.1:8080"


# ------------------------------------------------------------------------------- extraction

def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1).strip().lower(), m.group(2))
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, flags=re.M | re.S)]


def logical_lines(body: str) -> list[str]:
    """Lines with backslash continuations joined; blank and comment-only lines dropped."""
    out, cur = [], ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip() and not cur.strip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def split_commands(line: str) -> list[list[str]]:
    """A shell line -> its simple commands' argv (split at && || ; |, comments dropped,
    leading VAR=value assignments and subshell parentheses removed)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    lex.commenters = "#"
    cmds, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|()"):
            if cur:
                cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    if cur:
        cmds.append(cur)
    out = []
    for argv in cmds:
        while argv and ENV_ASSIGNMENT.match(argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def readme_shell_lines() -> list[str]:
    return [line for lang, body in code_blocks(README.read_text()) if lang in SHELL_LANGS
            for line in logical_lines(body)]


def serve_config_lines() -> list[str]:
    """The commands in deploy/serve_config.yaml's header comment (lines `#   <command>`)."""
    lines = []
    for line in SERVE_CONFIG.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#   "):
            lines.append(line[1:].strip())
    return lines


def all_commands() -> list[tuple[str, list[str]]]:
    out = []
    for src, lines in (("README.md", readme_shell_lines()), ("serve_config.yaml", serve_config_lines())):
        for line in lines:
            out += [(src, argv) for argv in split_commands(line)]
    return out


def program(argv: list[str]) -> str:
    return Path(argv[0]).name


COMMANDS = all_commands()
CHECKED = [(src, argv) for src, argv in COMMANDS if program(argv) not in UNCHECKED | {"curl"}]


# ------------------------------------------------------------------------------- checkers

def check_glm_ray(argv: list[str]) -> None:
    from glm_ray.cli import build_parser, serve_app_args
    from glm_ray.serve.args import ServeArgs
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(argv)
    except SystemExit as e:       # --help / --version exit 0; a parse error exits 2
        assert e.code == 0, f"glm-ray {shlex.join(argv)}: {err.getvalue().strip()}"
        return
    if ns.cmd == "serve":
        ServeArgs.from_dict(serve_app_args(ns))


def check_serve_app(import_or_config: str, arguments: tuple[str, ...]) -> None:
    """`serve run|deploy IMPORT k=v ...` or `serve run|deploy CONFIG.yaml`."""
    from glm_ray.serve.args import ServeArgs
    if import_or_config.endswith((".yaml", ".yml")):
        path = ROOT / import_or_config
        assert path.is_file(), f"{import_or_config} does not exist"
        assert not arguments, "a config file takes no key=value arguments"
        for app in yaml.safe_load(path.read_text())["applications"]:
            if app["import_path"].startswith("glm_ray."):
                ServeArgs.from_dict(app.get("args"))
        return
    module, _, attr = import_or_config.partition(":")
    builder = getattr(importlib.import_module(module), attr)
    from glm_ray.serve.app import build_app
    assert builder is build_app, f"{import_or_config} is not glm-ray's app builder"
    kv = {}
    for a in arguments:                      # as ray.serve.scripts.convert_args_to_dict does
        key, sep, val = a.partition("=")
        assert sep and val, f"app argument {a!r} is not key=value"
        kv[key] = val
    ServeArgs.from_dict(kv)                  # every value a string, as `serve run` passes it


def check_click(group, prog: str, argv: list[str]) -> None:
    import click
    assert argv, f"`{prog}` without a subcommand"
    sub = group.get_command(None, argv[0])
    assert sub is not None, f"`{prog} {argv[0]}`: no such command"
    try:
        ctx = sub.make_context(f"{prog} {argv[0]}", list(argv[1:]))
    except click.exceptions.Exit as e:       # --help
        assert e.exit_code == 0
        return
    except click.ClickException as e:
        pytest.fail(f"{prog} {shlex.join(argv)}: {e.format_message()}")
    if prog == "serve" and argv[0] in ("run", "deploy"):
        check_serve_app(ctx.params["config_or_import_path"], tuple(ctx.params["arguments"]))


def check_python_module(module: str, argv: list[str], monkeypatch) -> None:
    assert module.startswith("glm_ray."), f"python -m {module}: not ours"
    mod = importlib.import_module(module)

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            mod.main(argv)
    except Parsed:
        return
    except SystemExit as e:
        assert e.code == 0, f"python -m {module} {shlex.join(argv)}: {err.getvalue().strip()}"
        return
    pytest.fail(f"python -m {module}: main() never parsed its arguments")


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.M))


def check_make(argv: list[str], monkeypatch) -> None:
    targets, variables = [], {}
    for a in argv[1:]:
        if "=" in a:
            k, _, v = a.partition("=")
            variables[k] = v
        elif not a.startswith("-"):
            targets.append(a)
    unknown = set(targets) - makefile_targets()
    assert not unknown, f"make {shlex.join(argv[1:])}: no Makefile target {sorted(unknown)}"
    extra = shlex.split(variables.get("ARGS", ""))
    if "serve" in targets:
        check_glm_ray(["serve", *extra])
    if "bench-cpu" in targets:
        check_python_module("glm_ray.bench.offline", extra, monkeypatch)


def check_command(argv: list[str], monkeypatch) -> None:
    prog = program(argv)
    if prog == "glm-ray":
        check_glm_ray(argv[1:])
    elif prog == "serve":
        from ray.serve.scripts import cli
        check_click(cli, "serve", argv[1:])
    elif prog == "ray":
        from ray.scripts.scripts import cli
        check_click(cli, "ray", argv[1:])
    elif prog == "make":
        check_make(argv, monkeypatch)
    elif prog in ("python", "python3") and argv[1:2] == ["-m"]:
        check_python_module(argv[2], argv[3:], monkeypatch)
    else:
        pytest.fail(f"{shlex.join(argv)}: a command this test does not know (check it here, or add "
                    f"{prog!r} to UNCHECKED if it is not ours)")


# ------------------------------------------------------------------------------- parse tests

def test_extraction_finds_the_commands():
    """Guards the extractor: a README whose commands it cannot see would pass vacuously."""
    progs = [program(argv) for _, argv in COMMANDS]
    assert progs.count("glm-ray") >= 15
    assert progs.count("serve") >= 6 and progs.count("ray") >= 2 and progs.count("make") >= 1
    assert progs.count("curl") >= 5
    sub = {tuple(argv[:2]) for _, argv in COMMANDS if program(argv) == "serve"}
    assert {("serve", "run"), ("serve", "deploy"), ("serve", "status")} <= sub
    assert any(program(argv) == "ray" and argv[1] == "start" for _, argv in COMMANDS)
    assert any(src == "serve_config.yaml" for src, _ in CHECKED)


@pytest.mark.parametrize("src,argv", CHECKED, ids=lambda v: v if isinstance(v, str) else shlex.join(v)[:80])
def test_command_parses(src, argv, monkeypatch):
    check_command(argv, monkeypatch)


def test_checker_catches_broken_commands(monkeypatch):
    """The checks fail on what a README edit could break: a flag, a value, a key, a target."""
    bad = [["glm-ray", "serve", "--tp", "two"], ["glm-ray", "serve", "--max-num-sequences", "8"],
           ["glm-ray", "serve", "--tp", "0"], ["glm-ray", "quantise", "a", "b"],
           ["serve", "run", "glm_ray.serve.app:build_app", "tp=abc"],
           ["serve", "run", "glm_ray.serve.app:build_app", "tensor_parallel=2"],
           ["serve", "deploy", "deploy/no_such_config.yaml"], ["serve", "deploi", "x.yaml"],
           ["ray", "start", "--head", "--node-ip=127.0.0.1"], ["make", "serv"],
           ["make", "serve", "ARGS=--prot 9000"], ["python", "-m", "glm_ray.bench.offline", "--batches", "1"],
           ["vllm", "serve", "x"]]
    for argv in bad:
        with pytest.raises((AssertionError, ValueError, pytest.fail.Exception)):
            check_command(argv, monkeypatch)


def test_serve_run_string_forms():
    """What `serve run glm_ray.serve.app:build_app k=v ...` passes: strings, parsed by field type."""
    from glm_ray.serve.args import ServeArgs
    a = ServeArgs.from_dict({"model": "tiny", "tp": "2", "fp8_proj_gemm": "true", "gpu_memory_utilization": "0.8",
                             "max_model_len": "none", "kv_cache_memory_gb": "0.25", "router_cpus": "1"})
    assert (a.tp, a.fp8_proj_gemm, a.gpu_memory_utilization, a.max_model_len, a.kv_cache_memory_gb,
            a.router_cpus) == (2, True, 0.8, None, 0.25, 1.0)


# ------------------------------------------------------------------------------- the curl examples

def readme_curls() -> list[str]:
    return [line for line in readme_shell_lines() if split_commands(line)
            and program(split_commands(line)[0]) == "curl"]


def _run_curl(line: str, http: str, metrics: str) -> tuple[bool, str]:
    urls = set(re.findall(r"https?://[^\s'\"/]+", line))
    assert urls <= {README_HTTP, README_METRICS}, f"{line}: README curl examples use {README_HTTP} or {README_METRICS}"
    cmd = line.replace(README_HTTP, http).replace(README_METRICS, metrics)
    piped = "|" in split_commands_raw(cmd)
    if not piped:     # status code and body checked here: curl itself exits 0 on an HTTP error
        cmd = re.sub(r"^curl\b", "curl -sS -w '\\n__HTTP %{http_code}__'", cmd)
    env = dict(os.environ, GLM_RAY_API_KEY=os.environ.get("GLM_RAY_API_KEY", "readme-test-key"))
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout
    if r.returncode != 0:
        return False, f"exit {r.returncode}: {r.stderr.strip()[-500:]} {out[-500:]}"
    if piped:
        return bool(out.strip()), out[-500:] or "no output"
    m = re.search(r"\n__HTTP (\d+)__$", out)
    body, status = out[:m.start()] if m else out, int(m.group(1)) if m else 0
    if status != 200:
        return False, f"HTTP {status}: {body[-500:]}"
    if body.lstrip().startswith("data:"):        # SSE
        events = [ln[len("data: "):] for ln in body.splitlines() if ln.startswith("data: ")]
        ok = events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
        return ok, body[-500:]
    doc = json.loads(body)
    return "error" not in doc, body[-500:]


def split_commands_raw(cmd: str) -> list[str]:
    lex = shlex.shlex(cmd, posix=True, punctuation_chars="|")
    lex.whitespace_split = True
    return list(lex)


def test_readme_curl_examples_run(serve_cluster, tiny_server):
    curls = readme_curls()
    assert len(curls) >= 5
    metrics = f"http://127.0.0.1:{serve_cluster.metrics_port}"
    for line in curls:
        deadline = time.time() + 90        # the metrics line waits for Ray's next export
        while True:
            ok, detail = _run_curl(line, tiny_server.base_url, metrics)
            if ok or time.time() > deadline:
                break
            time.sleep(3)
        assert ok, f"README command failed against the tiny app:\n  {line}\n  {detail}"


def test_readme_model_id_is_the_served_one(tiny_server):
    """The README's requests name the tiny app's model id (what `glm-ray serve` prints)."""
    models = set(re.findall(r'"model":\s*"([^"]+)"', " ".join(readme_curls())))
    assert models == {tiny_server.model}


def test_curl_check_catches_failures():
    """The curl check fails on an HTTP error, an error body, an SSE error event and an empty grep;
    passes on a 200 JSON body and a complete SSE stream (a local stand-in server)."""
    import http.server
    import threading

    replies = {"/ok": (200, '{"object": "list"}'), "/missing": (404, '{"error": {"message": "nope"}}'),
               "/err200": (200, '{"error": {"message": "x"}}'),
               "/sse": (200, 'data: {"choices": []}\n\ndata: [DONE]\n\n'),
               "/sse-err": (200, 'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n'),
               "/metrics": (200, "ray_glm_ray_x 1\n")}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = replies[self.path]
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        def run(path, pipe=""):
            return _run_curl(f"curl {README_HTTP}{path}{pipe}", base, base)[0]
        assert run("/ok") and run("/sse") and run("/metrics", " | grep ^ray_glm_ray")
        assert not any([run("/missing"), run("/err200"), run("/sse-err"), run("/metrics", " | grep ^nothing")])
        with pytest.raises(AssertionError, match="README curl examples use"):
            _run_curl("curl http://example.com/v1/models", base, base)
    finally:
        srv.shutdown()
