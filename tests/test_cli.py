"""``devin-compile``: fast plain help, every argument checked before a model loads, bad model
paths as one-line errors, full pass names when piped, and the HF peer's dtype said in the table."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from devin_compile import benchmarking
from devin_compile.cli import build_parser, common, main

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["[UNK]", "<s>", "</s>", "what", "is", "the", "capital", "of", "france", "?", "a", "haiku"]


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if a subcommand gets as far as loading a model."""

    def boom(*a, **k):
        raise AssertionError("the CLI loaded a model before rejecting its arguments")

    monkeypatch.setattr(common, "load", boom)


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


def _tiny_llama(folder: Path, weights: bool = True, tokenizer: bool = True) -> Path:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    if weights:
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(folder)
    else:
        cfg.save_pretrained(folder)
    if tokenizer:
        _tokenizer().save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- help
def test_help_imports_neither_torch_nor_transformers():
    code = ("import sys\nfrom devin_compile.cli import build_parser\n"
            "for c in ('', 'run', 'serve', 'chat', 'dump', 'quantize'):\n    build_parser(c).format_help()\n"
            "print(sorted(m for m in ('torch', 'transformers', 'starlette', 'uvicorn') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_flag_has_plain_help():
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            assert action.help, f"{parser.prog} {action.option_strings} has no help"
        text = parser.format_help()
        for markup in ("``", ":mod:", ":func:", ":class:"):
            assert markup not in text, f"{parser.prog} --help shows {markup!r}"


def test_python_dash_m_runs_the_cli():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "devin_compile.cli", "run", "--help"], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0 and "--max-new-tokens" in out.stdout


# ---------------------------------------------------------------- arguments checked first
@pytest.mark.parametrize("argv, message", [
    (["run", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be a positive integer, got -1"),
    (["run", "--bench-tokens", "1"], "argument --bench-tokens: must be an integer >= 2, got 1"),
    (["run", "--repeats", "zero"], "argument --repeats: 'zero' is not an integer"),
    (["quantize", "calibrate", "--chunks", "0", "--out", "x"], "argument --chunks: must be a positive integer"),
])
def test_bad_numbers_are_refused_while_parsing(no_load, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["run", "--dtype", "float8"], "dtype='float8' is not supported"),
    (["run", "--attention-backend", "warp_speed"], "attention_backend='warp_speed' is unknown; valid: ["),
    (["run", "--prompt", " "], "--prompt must not be empty"),
    (["dump", "--out", "d", "--model", "/no/such/model"], "--model /no/such/model does not exist"),
    (["quantize", "calibrate", "--data", "/no/such.txt", "--out", "x"], "--data /no/such.txt does not exist"),
    (["quantize", "validate", "--quantized", "/no/such/dir"], "--quantized /no/such/dir is not a directory"),
])
def test_bad_options_are_refused_before_loading(no_load, capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_quantize_run_checks_calib_dir_before_loading(no_load, tmp_path, capsys):
    assert main(["quantize", "run", "--calib", str(tmp_path), "--out", str(tmp_path / "q")]) == 2
    assert "is not a calibration directory" in capsys.readouterr().err


# ---------------------------------------------------------------- bad model paths: one line each
def _bert(folder: Path) -> Path:
    BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "README.md").write_text("# hi") and d / "README.md", "is a file but not a .gguf model"),
    (lambda d: d, "has no config.json, so it is not a Hugging Face model folder"),
    (_bert, "describes a 'bert' model (BertConfig), not a causal (decoder-only) LM"),
    (lambda d: _tiny_llama(d, tokenizer=False), "has no tokenizer files"),
    (lambda d: _tiny_llama(d, weights=False), "no file named model.safetensors"),
])
def test_bad_model_paths_are_one_line_errors(tmp_path, capsys, make, message):
    path = make(tmp_path)
    capsys.readouterr()  # drop what saving the folder printed
    assert main(["run", "--model", str(path), "--no-bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("devin-compile: error: ") and "\n" not in err and "Traceback" not in err
    assert message in err and str(path) in err


# ---------------------------------------------------------------- run on a tiny model
def test_run_prints_full_pass_names_when_piped(tmp_path, capsys):
    model = _tiny_llama(tmp_path / "tiny")
    capsys.readouterr()
    assert main(["run", "--model", str(model), "--no-bench", "--max-new-tokens", "2", "--prompt",
                 "what is the capital of france ?"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out  # rich cuts a cell with an ellipsis
    for name in ("attention_to_paged", "fuse_attention_inputs", "fuse_projections", "split_phases"):
        assert name in out


def test_cold_start_progress_on_stderr_and_quiet_hides_it(tmp_path, capsys):
    """A cold start says what it is doing (capture, passes, engine build) on stderr; -q keeps only warnings."""
    model = str(_tiny_llama(tmp_path / "tiny"))
    argv = ["run", "--model", model, "--no-bench", "--max-new-tokens", "1", "--prompt", "hi"]
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    for line in ("capturing LlamaForCausalLM with torch.export", "captured LlamaForCausalLM in",
                 "running ", "passes done in", "engine built in"):
        assert f"devin-compile: {line}" in err, err
    assert main(["-q", *argv]) == 0
    assert "capturing" not in capsys.readouterr().err
    main(argv)  # the next call without -q shows progress again
    assert "passes done in" in capsys.readouterr().err


def test_hf_peer_runs_in_float32_where_bf16_is_not_native(tmp_path, capsys, monkeypatch):
    import devin_compile.ops.onednn_linear as onednn

    monkeypatch.setattr(onednn, "onednn_supports", lambda dtype: dtype == torch.float32)
    model = _tiny_llama(tmp_path / "tiny")
    assert main(["run", "--model", str(model), "--dtype", "bfloat16", "--max-new-tokens", "2", "--bench-tokens", "3",
                 "--repeats", "1", "--prompt", "what is the capital"]) == 0
    out = capsys.readouterr().out
    assert "HF eager (float32)*" in out
    assert "* bfloat16 is not native on this CPU, so HF eager runs in float32" in out
    assert "same greedy tokens: n/a (HF ran in float32)" in out


@pytest.mark.parametrize("method", ["ngram", "head"])
def test_run_speculative_prints_side_by_side_row_and_acceptance_table(tmp_path, capsys, method):
    model = _tiny_llama(tmp_path / "tiny")
    capsys.readouterr()
    assert main(["run", "--model", str(model), "--max-new-tokens", "2", "--bench-tokens", "6", "--repeats", "1",
                 "--speculative", method, "--spec-tokens", "3", "--head-layers", "1",
                 "--prompt", "what is the capital of france ?"]) == 0
    out = capsys.readouterr().out
    assert f"devin-compile + {method}" in out
    assert "same greedy tokens as devin-compile: True" in " ".join(out.split())
    assert f"acceptance ({method})" in out and "verify steps" in out


def test_hf_peer_dtype(monkeypatch):
    import devin_compile.ops.onednn_linear as onednn

    fp32 = torch.nn.Linear(2, 2)
    assert benchmarking.hf_peer_dtype(fp32) == (torch.float32, "")
    monkeypatch.setattr(onednn, "onednn_supports", lambda dtype: True)
    assert benchmarking.hf_peer_dtype(fp32.to(torch.bfloat16)) == (torch.bfloat16, "")
    monkeypatch.setattr(onednn, "onednn_supports", lambda dtype: False)
    assert benchmarking.hf_peer_dtype(fp32.to(torch.float16)) == (torch.float32, "float16 is not native on this CPU")


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "-1"], "argument --port: must be an integer >= 0, got -1"),
    (["serve", "--shutdown-timeout", "0"], "argument --shutdown-timeout: must be a number > 0"),
    (["serve", "--option", "nonsense"], "argument --option: 'nonsense' is not KEY=VALUE"),
    (["chat", "--max-new-tokens", "0"], "argument --max-new-tokens: must be a positive integer"),
])
def test_serve_and_chat_numbers_refused_while_parsing(no_load, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_serve_options_refused_before_loading(no_load, tmp_path, capsys):
    assert main(["serve", "--option", "max_num_seqs=0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert main(["serve", "--option", "warp=9"]) == 2
    assert "unknown option 'warp'" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "none.json")]) == 2
    assert "is not a file" in capsys.readouterr().err
    (tmp_path / "c.json").write_text("[1]")
    assert main(["chat", "--config", str(tmp_path / "c.json")]) == 2
    assert "must hold a JSON object" in capsys.readouterr().err
