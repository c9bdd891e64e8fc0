"""``devin-compile serve`` as a process (ephemeral port, answers the openai client, SIGTERM →
in-flight request finished, exit 0) and ``devin-compile chat`` (history, /reset, streamed
replies equal to ``opt.chat``); both on the tiny model with SmolLM2's tokenizer."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from openai import AuthenticationError, BadRequestError, OpenAI

from devin_compile.cli import common, main
from serve_model import tiny_chat_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny-chat"))


def read_lines_until(proc, marker: str, limit_s: float) -> list[str]:
    """``proc``'s stdout lines up to the first holding ``marker`` (AssertionError with them after ``limit_s``)."""
    lines: list[str] = []
    done = threading.Event()

    def reader():
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                done.set()
                return

    threading.Thread(target=reader, daemon=True).start()
    if not done.wait(limit_s):
        proc.kill()
        raise AssertionError("server did not start:\n" + "".join(lines) + proc.stderr.read())
    return lines


def test_serve_process_answers_and_shuts_down_gracefully(folder):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "devin_compile.cli", "serve", "--model", str(folder), "--port",
                             "0", "--num-kv-blocks", "64", "--served-model-name", "tiny", "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = read_lines_until(proc, "serving tiny on http://127.0.0.1:", 240)[-1]
        url = line.split(" on ", 1)[1].split()[0]
        client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == "tiny"
        full = client.completions.create(model="tiny", prompt="Tell me 日", max_tokens=48, temperature=0,
                                         extra_body={"ignore_eos": True})
        stream = client.completions.create(model="tiny", prompt="Tell me 日", max_tokens=48, temperature=0,
                                           extra_body={"ignore_eos": True}, stream=True)
        parts = [next(iter(stream)).choices[0].text]
        proc.send_signal(signal.SIGTERM)  # in flight: it is let finish
        parts += [c.choices[0].text for c in stream]
        assert "".join(parts) == full.choices[0].text
        assert proc.wait(timeout=60) == 0
        assert "server stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def keep_optimized(monkeypatch) -> dict:
    """``{"opt": ...}`` filled with the OptimizedModel the CLI builds next (common.optimize wrapped)."""
    seen = {}
    real = common.optimize

    def keep(*a, **k):
        seen["opt"] = real(*a, **k)
        return seen["opt"]

    monkeypatch.setattr(common, "optimize", keep)
    return seen


def test_chat_keeps_history_and_streams(folder, monkeypatch, capsys):
    seen = keep_optimized(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me 日\nAnd more?\n/reset\nHi\n/exit\nnever read\n"))
    assert main(["chat", "--model", str(folder), "--num-kv-blocks", "64", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    replies = [line.split("assistant> ", 1)[1] for line in out.splitlines() if line.startswith("assistant> ")]
    opt = seen["opt"]
    first = opt.chat([{"role": "user", "content": "Tell me 日"}], 12)
    second = opt.chat([{"role": "user", "content": "Tell me 日"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "And more?"}], 12)
    after_reset = opt.chat([{"role": "user", "content": "Hi"}], 12)
    assert replies == [first, second, after_reset] and "(history cleared)" in out
    assert opt.engine.kv.allocator.num_used == 0


def test_serve_flags_speculative_and_trace_steps(monkeypatch):
    from devin_compile.cli import serve as serve_cli

    p = __import__("argparse").ArgumentParser()
    serve_cli.add_arguments(p)
    opts = serve_cli.optimize_options(p.parse_args(["--speculative", "ngram", "--spec-tokens", "3"]))
    assert opts["speculative"] == {"method": "ngram", "num_tokens": 3}
    assert serve_cli.optimize_options(p.parse_args(["--speculative", "head", "--head-layers", "1"]))["speculative"] \
        == {"method": "head", "num_tokens": 4, "layers": 1}
    assert "speculative" not in serve_cli.optimize_options(p.parse_args([]))
    with pytest.raises(FileNotFoundError, match="--draft-model"):
        serve_cli.optimize_options(p.parse_args(["--speculative", "draft", "--draft-model", "/no/such/model"]))
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="--trace-steps needs tracing"):
        serve_cli.main(p.parse_args(["--trace-steps"]))  # refused before any model is loaded


def test_serve_process_speculates_and_traces_steps(folder, tmp_path):
    """--speculative ngram --spec-tokens 3 --trace-file F --trace-steps: the spec counters grow, and
    F holds the request's span with step spans under it."""
    import json
    import urllib.request

    from serve_model import REPLAY

    spans_file = tmp_path / "spans.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "devin_compile.cli", "serve", "--model", str(folder), "--port",
                             "0", "--num-kv-blocks", "64", "--served-model-name", "tiny", "--speculative", "ngram",
                             "--spec-tokens", "3", "--trace-file", str(spans_file), "--trace-steps"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = read_lines_until(proc, "serving tiny on http://127.0.0.1:", 240)[-1].split(" on ", 1)[1].split()[0]
        client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt=REPLAY * 2, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 20
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as m:
            text = m.read().decode()
        counters = {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                             if ln.startswith("devin_spec_"))}
        assert counters["devin_spec_draft_tokens_total"] > 0 and counters["devin_spec_accepted_tokens_total"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    (request,) = [s for s in spans if s["name"] == "text_completion tiny"]
    steps = [s for s in spans if s["name"] == "devin.engine.step"]
    assert steps and all(s["parent_id"] == request["context"]["span_id"] for s in steps)
    assert all(s["context"]["trace_id"] == request["context"]["trace_id"] for s in steps)
    assert sum(s["attributes"]["devin.step.accepted_tokens"] for s in steps) > 0
    assert request["attributes"]["devin.spec.acceptance_rate"] > 0


def test_serve_front_door_flags(monkeypatch, capsys):
    """Keys from --api-key (repeatable) or else DEVIN_API_KEY, limits, the access log; a bad key or
    --metrics-auth without one is refused before any model loads, and the key is not echoed."""
    from devin_compile.cli import build_parser, serve as serve_cli
    from devin_compile.serve.server import exposure_warning

    p = build_parser("serve")
    args = p.parse_args(["serve", "--api-key", "k-one", "--api-key", "k-two", "--max-n", "4", "--no-access-log"])
    opts = serve_cli.server_options(args, environ={"DEVIN_API_KEY": "k-env"})
    assert opts["api_keys"] == ["k-one", "k-two"] and opts["limits"].max_n == 4 and not opts["access_log"]
    defaults = serve_cli.server_options(p.parse_args(["serve"]), environ={"DEVIN_API_KEY": "k-env"})
    assert defaults["api_keys"] == ["k-env"] and defaults["access_log"] and defaults["metrics_auth"] is False
    assert (defaults["limits"].max_body_bytes, defaults["limits"].max_prompt_tokens, defaults["limits"].max_tokens,
            defaults["limits"].max_connections) == (1 << 20, 8192, 4096, 256)
    with pytest.raises(ValueError, match="--metrics-auth needs an API key"):
        serve_cli.server_options(p.parse_args(["serve", "--metrics-auth"]), environ={})
    for bad in (["--api-key", "secret with spaces"], ["--max-connections", "0"]):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", *bad])
        err = capsys.readouterr().err
        assert bad[0] in err and "secret" not in err
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--api-key", "--metrics-auth", "--max-body-bytes", "--max-prompt-tokens", "--max-n",
                 "--max-tokens-limit", "--max-connections", "--no-access-log"):
        assert flag in help_text
    for host, key, warned in [("0.0.0.0", False, True), ("192.168.1.5", False, True), ("::", False, True),
                              ("0.0.0.0", True, False), ("127.0.0.1", False, False), ("::1", False, False),
                              ("localhost", False, False)]:
        w = exposure_warning(host, key)
        assert (w is not None) == warned and (w is None or "--api-key" in w)


def test_serve_process_with_keys_logs_requests_and_never_the_keys(folder):
    """--api-key beats DEVIN_API_KEY; 401 without it; an access-log line per request on stderr; neither
    key appears anywhere in the process's output."""
    flag_key, env_key = "sk-flag-7f3a9c", "sk-env-51d2e8"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DEVIN_API_KEY": env_key}
    proc = subprocess.Popen([sys.executable, "-m", "devin_compile.cli", "serve", "--model", str(folder), "--port",
                             "0", "--num-kv-blocks", "64", "--served-model-name", "tiny", "--api-key", flag_key],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = read_lines_until(proc, "serving tiny on http://127.0.0.1:", 240)[-1]
        url = first.split(" on ", 1)[1].split()[0]
        ok = OpenAI(base_url=url, api_key=flag_key, max_retries=0, timeout=60)
        assert ok.completions.create(model="tiny", prompt="Tell me", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 3
        for key in (env_key, "wrong"):
            with pytest.raises(AuthenticationError):
                OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60).models.list()
        with pytest.raises(BadRequestError):
            ok.completions.create(model="tiny", prompt="x", max_tokens=0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    log = [line for line in err.splitlines() if line.startswith("127.0.0.1:")]
    assert [line.split()[1:4] for line in log] == [["POST", "/v1/completions", "200"], ["GET", "/v1/models", "401"],
                                                  ["GET", "/v1/models", "401"], ["POST", "/v1/completions", "400"]]
    assert log[0].split()[5].endswith("/3") and "warning" not in err  # loopback: no exposure warning
    assert flag_key not in first + out + err and env_key not in first + out + err
