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
    assert opt.engine.allocator.num_used == 0
