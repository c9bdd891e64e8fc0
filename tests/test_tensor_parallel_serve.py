"""``devin-compile serve|run --tensor-parallel 2`` as processes (issue 40, parts 3 and 4), on the tiny chat
model with SmolLM2's tokenizer (tests/serve_model.py), 127.0.0.1 only, every wait bounded.

- the server spawns its two ranks itself, answers the openai client with the same text as one process
  (plain and streamed), and SIGTERM stops every rank (exit 0, no process left);
- a killed rank 1 ends the server with a message naming it, a hung one (SIGSTOP) makes /health 503 or the
  server exit within the rank timeout; no process is left either way;
- ``run`` launched by torchrun prints the text one process generates.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from serve_model import openai_client, running_server, smollm2_tokenizer, tiny_chat_folder, tiny_chat_opt
from test_serve_cli import read_lines_until

ROOT = Path(__file__).resolve().parents[1]
START_S = 300  # two ranks load, capture and compile on a 2-core machine
PROMPTS = ["Tell me 日", "The capital of France is"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def one_process() -> list[str]:
    """What one process answers: each prompt plain and streamed, 24 greedy tokens."""
    with running_server(tiny_chat_opt(num_kv_blocks=64), "tiny") as server:
        return _ask(openai_client(server))


def _ask(client: OpenAI) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        args = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        texts.append(client.completions.create(**args).choices[0].text)
        texts.append("".join(c.choices[0].text for c in client.completions.create(**args, stream=True)))
    return texts


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _start(folder: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "devin_compile.cli", "-q", "serve", "--model", str(folder),
                             "--port", "0", "--num-kv-blocks", "64", "--served-model-name", "tiny",
                             "--shutdown-timeout", "10", "--tensor-parallel", "2", "--no-access-log", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    line = read_lines_until(proc, "serving tiny on http://127.0.0.1:", START_S)[-1]
    return proc, line.split(" on ", 1)[1].split()[0].removesuffix("/v1")


def _ranks(launcher: int) -> dict[int, int]:
    """rank → pid of the launcher's children (from /proc: their RANK variable)."""
    out = {}
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        out[int(env["RANK"])] = int(pid)
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None  # the server is gone


def _cleanup(proc: subprocess.Popen, pids) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_server_with_two_ranks_answers_like_one_process(folder, one_process):
    proc, url = _start(folder)
    ranks = _ranks(proc.pid)
    try:
        assert sorted(ranks) == [0, 1]
        assert _ask(OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)) == one_process
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "server stopped" in proc.stderr.read()
        assert all(_gone(pid) for pid in ranks.values())
    finally:
        _cleanup(proc, ranks.values())


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_lost_rank_stops_the_server(folder, fault):
    """SIGKILL (dies) or SIGSTOP (hangs) rank 1 of an idle server: within the rank timeout (10 s) plus the
    watch's ping interval, /health answers 503 or the server is gone; the launcher exits 1 with a message
    naming what happened, and no rank is left."""
    proc, url = _start(folder, "--tp-timeout", "10")
    ranks = _ranks(proc.pid)
    try:
        assert _health(url) == 200
        os.kill(ranks[1], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while _health(url) == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _health(url) != 200
        assert proc.wait(timeout=60) == 1
        err = proc.stderr.read()
        if fault == "kill":
            assert "tensor-parallel rank 1 was killed by SIGKILL; stopping the other ranks" in err
        else:
            assert "tensor-parallel group of 2 ranks lost: a rank stopped answering" in err
            assert "tensor-parallel rank 0 exited with status 1" in err
        assert all(_gone(pid) for pid in ranks.values())
    finally:
        _cleanup(proc, ranks.values())


def test_run_under_torchrun_prints_what_one_process_generates(folder):
    from devin_compile.cli.launch import free_port

    tok = smollm2_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    want = tok.decode(tiny_chat_opt(num_kv_blocks=64).generate([ids], max_new_tokens=16)[0],
                      skip_special_tokens=True).strip()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "devin_compile.cli", "-q", "run", "--model", str(folder),
           "--tensor-parallel", "2", "--prompt", PROMPTS[1], "--max-new-tokens", "16", "--no-bench"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)  # torchrun and its ranks in one process group
    try:
        out, err = proc.communicate(timeout=START_S)
    finally:
        if proc.poll() is None:  # a hang: no rank is left behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert want and want in out
    assert out.count(f"{PROMPTS[1]}") == 1  # rank 0 prints; rank 1 is quiet


@pytest.mark.parametrize("argv, env, message", [
    (["run", "--prompt", "hi"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "launched as 2 processes (torchrun) without --tensor-parallel: give --tensor-parallel 2"),
    (["run", "--tensor-parallel", "2", "--speculative", "ngram"], {},
     "--speculative with --tensor-parallel: run times a second engine"),
    (["serve", "--tensor-parallel", "2", "--option", "kv_prune=true"], {},
     "tensor_parallel=2 with kv_prune= is not supported yet"),
])
def test_bad_tensor_parallel_command_lines_fail_before_loading(monkeypatch, capsys, argv, env, message):
    """One error line and exit 2, before any rank is spawned or model loaded."""
    from devin_compile.cli import main

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("devin_compile.cli.launch.spawn_ranks", lambda *a, **k: pytest.fail("spawned ranks"))
    monkeypatch.setattr("devin_compile.models.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["-q", *argv]) == 2
    assert message in capsys.readouterr().err
