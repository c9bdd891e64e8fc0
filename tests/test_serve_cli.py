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
from openai import OpenAI

from devin_compile.cli import common, main
from serve_model import tiny_chat_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny-chat"))


def _read_until(proc, marker: str, limit_s: float) -> str:
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
    return lines[-1]


def test_serve_process_answers_and_shuts_down_gracefully(folder):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "devin_compile.cli", "serve", "--model", str(folder), "--port",
                             "0", "--num-kv-blocks", "64", "--served-model-name", "tiny", "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = _read_until(proc, "serving tiny on http://127.0.0.1:", 240)
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


def test_chat_keeps_history_and_streams(folder, monkeypatch, capsys):
    seen = {}
    real = common.optimize

    def keep(*a, **k):
        seen["opt"] = real(*a, **k)
        return seen["opt"]

    monkeypatch.setattr(common, "optimize", keep)
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
        url = _read_until(proc, "serving tiny on http://127.0.0.1:", 240).split(" on ", 1)[1].split()[0]
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
