"""``devin-compile run | serve | chat --quantized DIR`` and ``--quantize METHOD``: the artifact's
weights are the ones served (same greedy text as ``optimize(quantized=DIR)`` in Python), the
precision table is printed at start, and a bad or mismatched artifact is one error line, exit 2.
Tiny models; the artifact is RTN on a few calibration tokens, made through the CLI."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devin_compile.cli import common, main
from devin_compile.quant import corpus
from serve_model import REPLAY, smollm2_tokenizer, tiny_chat_folder, tiny_chat_opt
from test_cli import _tiny_llama
from test_serve_cli import keep_optimized, read_lines_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(model folder, artifact folder): the tiny chat model and its RTN INT4 g32 artifact."""
    root = tmp_path_factory.mktemp("quant-flags")
    folder = tiny_chat_folder(root / "tiny")
    text = root / "text.txt"
    text.write_text((REPLAY + " The quick brown fox jumps over the lazy dog.\n") * 40)
    assert main(["quantize", "calibrate", "--model", str(folder), "--data", str(text), "--chunks", "2",
                 "--chunk-len", "64", "--quiet", "--out", str(root / "calib")]) == 0
    assert main(["quantize", "run", "--model", str(folder), "--calib", str(root / "calib"), "--method", "rtn",
                 "--group-size", "32", "--quiet", "--out", str(root / "q")]) == 0
    return folder, root / "q"


@pytest.fixture
def no_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the CLI loaded a model before rejecting its arguments")

    monkeypatch.setattr(common, "load", boom)


def _error_line(capsys, loaded: bool = False) -> str:
    """The one line the CLI wrote to stderr (``loaded``: after the bars transformers draws loading weights)."""
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("devin-compile: error: ") and "Traceback" not in err, err
    assert loaded or last == err, err
    return last


# ---------------------------------------------------------------- the artifact is what runs
def test_run_quantized_prints_the_table_and_runs_the_artifact(made, monkeypatch, capsys):
    folder, q = made
    seen = keep_optimized(monkeypatch)
    capsys.readouterr()
    assert main(["run", "--model", str(folder), "--quantized", str(q), "--no-bench", "--max-new-tokens", "8",
                 "--prompt", "Tell me"]) == 0
    out = capsys.readouterr().out
    opt = seen["opt"]
    assert opt.quant_result.method == "rtn" and opt.quant_result.fingerprint == json.loads(
        (q / "quant_config.json").read_text())["fingerprint"]
    assert "06 assign_precision" in out and "| int4 |" not in out  # rendered, not raw markdown
    rows = [line for line in out.splitlines() if "model.layers." in line and " int4 " in line]
    assert len(rows) == len(opt.precision_table) - 1 == 8  # 2 layers x (qkv, o, gate+up, down), + the INT8 head
    assert f"quantized weights (artifact {q}: rtn, g32, calibrated on 128 tokens): 8 int4, 1 int8 linears" in out
    # the same weights as Python's optimize(quantized=...): the same greedy text
    ref = tiny_chat_opt(quantized=str(q))
    tok = smollm2_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert opt.generate([ids], max_new_tokens=8) == ref.generate([ids], max_new_tokens=8)


def test_chat_quantized(made, monkeypatch, capsys):
    import io

    folder, q = made
    seen = keep_optimized(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me 日\n/exit\n"))
    assert main(["chat", "--model", str(folder), "--quantized", str(q), "--num-kv-blocks", "64",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    reply = next(line.split("assistant> ", 1)[1] for line in out.splitlines() if line.startswith("assistant> "))
    opt = seen["opt"]
    assert opt.quant_result is not None and "quantized weights (artifact" in out
    assert reply == opt.chat([{"role": "user", "content": "Tell me 日"}], 6)


def test_serve_quantized_answers_with_the_artifacts_weights(made):
    from openai import OpenAI

    folder, q = made
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "devin_compile.cli", "serve", "--model", str(folder), "--quantized",
                             str(q), "--port", "0", "--num-kv-blocks", "64", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = read_lines_until(proc, "serving tiny on http://127.0.0.1:", 240)
        start = "".join(lines)
        assert "06 assign_precision" in start and f"quantized weights (artifact {q}: rtn, g32" in start
        url = lines[-1].split(" on ", 1)[1].split()[0]
        client = OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt="Tell me 日", max_tokens=12, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True}).choices[0]
        tok = smollm2_tokenizer()
        ids = tok("Tell me 日")["input_ids"]
        ref = tiny_chat_opt(quantized=str(q))
        want = ref.generate([ids], max_new_tokens=12, ignore_eos=True)[0]
        assert got.text == tok.decode(want)
        # the logprobs served are the artifact's, not the unquantized model's
        served = torch.tensor(got.logprobs.token_logprobs)
        assert torch.allclose(served, _logprobs(ref, ids, want), atol=1e-4)
        assert (served - _logprobs(tiny_chat_opt(), ids, want)).abs().max() > 1e-3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _logprobs(opt, prompt: list[int], new: list[int]) -> torch.Tensor:
    """log p(new[i] | prompt + new[:i]) under ``opt``."""
    logits = opt(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(new)[:, None])[:, 0]


def test_run_quantize_on_the_fly(tmp_path, capsys):
    """--quantize rtn: the shipped set, 16 x 512 tokens; piped, progress is plain lines. The
    speculative engine timed beside it reuses the weights (one calibration, the same tokens)."""
    folder = _tiny_llama(tmp_path / "small")
    capsys.readouterr()
    assert main(["run", "--model", str(folder), "--quantize", "rtn", "--max-new-tokens", "2", "--bench-tokens", "3",
                 "--repeats", "1", "--speculative", "ngram", "--prompt", "what is the capital"]) == 0
    out = capsys.readouterr().out
    assert out.count("calibrating (16 x 512 tokens): started, 16 steps") == 1
    assert "same greedy tokens as devin-compile: True" in " ".join(out.split())
    assert "(devin-compile runs quantized weights)" in " ".join(out.split())
    assert "calibrating (16 x 512 tokens): 16/16 (100%), done in " in out
    assert "RTN INT4 g64: 14/14 (100%), done in " in out
    assert "quantized weights (quantized at start: rtn, g64, calibrated on 8192 tokens): 8 int4, 1 int8 linears" in out


def test_quantize_run_without_calib_calibrates_on_the_shipped_set(tmp_path, capsys):
    folder = _tiny_llama(tmp_path / "small")
    assert main(["quantize", "run", "--model", str(folder), "--method", "rtn", "--out", str(tmp_path / "q")]) == 0
    calib = json.loads((tmp_path / "q" / "quant_config.json").read_text())["calib"]
    assert calib["tokens"] == 16 * 512 and calib["data"] == corpus.DEFAULT_LABEL
    out = capsys.readouterr().out
    assert "calibrating (16 x 512 tokens): 16/16 (100%)" in out and "RTN INT4 g64: 14/14 (100%)" in out


# ---------------------------------------------------------------- bad artifacts: one line, exit 2
def _copy(q: Path, dest: Path) -> Path:
    shutil.copytree(q, dest)
    return dest


@pytest.mark.parametrize("command", ["run", "serve", "chat"])
def test_bad_artifacts_are_refused_before_loading(made, tmp_path, no_load, capsys, command):
    _folder, q = made
    (tmp_path / "empty").mkdir()
    assert main([command, "--quantized", str(tmp_path / "empty")]) == 2
    assert "is not a quantized-model directory (needs quant_config.json and quantized.safetensors" in \
        _error_line(capsys)
    corrupt = _copy(q, tmp_path / "corrupt")
    (corrupt / "quant_config.json").write_text('{"format": "devin-compile-int4", ')
    assert main([command, "--quantized", str(corrupt)]) == 2
    assert "quant_config.json is corrupted" in _error_line(capsys)
    partial = _copy(q, tmp_path / "partial")
    meta = json.loads((partial / "quant_config.json").read_text())
    del meta["linears"], meta["fingerprint"]
    (partial / "quant_config.json").write_text(json.dumps(meta))
    assert main([command, "--quantized", str(partial)]) == 2
    assert "fingerprint, linears missing or malformed" in _error_line(capsys)
    (partial / "quantized.safetensors").unlink()
    assert main([command, "--quantized", str(partial)]) == 2
    assert "is not a quantized-model directory" in _error_line(capsys)


def test_bad_flags_are_refused_while_parsing(made, no_load, capsys):
    _folder, q = made
    with pytest.raises(SystemExit) as e:
        main(["run", "--quantize", "hqq"])
    assert e.value.code == 2 and "argument --quantize: invalid choice: 'hqq'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--quantize", "rtn", "--quantized", str(q)])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_mismatched_and_truncated_artifacts_after_loading(made, tmp_path, capsys):
    folder, q = made
    other = _tiny_llama(tmp_path / "other")  # another model: another vocabulary, other weights
    capsys.readouterr()
    assert main(["run", "--model", str(other), "--quantized", str(q), "--no-bench"]) == 2
    err = _error_line(capsys, loaded=True)
    assert f"quantized model {q} was made for a different model (vocab_size:" in err
    assert "make one for this model with `devin-compile quantize calibrate` and `quantize run`" in err
    cut = _copy(q, tmp_path / "cut")
    data = (cut / "quantized.safetensors").read_bytes()
    (cut / "quantized.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["run", "--model", str(folder), "--quantized", str(cut), "--no-bench"]) == 2
    assert "quantized.safetensors is corrupted or truncated" in _error_line(capsys, loaded=True)


def test_cli_methods_are_the_library_methods():
    from devin_compile.quant import METHODS

    assert common.QUANT_METHODS == METHODS
