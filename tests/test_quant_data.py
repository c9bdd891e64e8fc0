"""The shipped calibration set and the data= / --data forms (files, folders, lists); progress
reporting is tests/test_progress.py. Tiny models only."""
from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from devin_compile import quant
from devin_compile.quant import QuantConfig, corpus

ROOT = Path(__file__).resolve().parents[1]


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False, **_):
        return {"input_ids": [3 + ord(c) % 250 for c in text]}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


# ---------------------------------------------------------------- the shipped set
def test_shipped_set_is_small_mixed_documented_and_packaged():
    files = corpus.source_files()
    assert [f.parent for f in files] == [corpus.default_data_dir()] * len(files)
    names = {f.name for f in files}
    assert {"dialogue-shakespeare.txt", "code-python-stdlib.txt", "technical-python-reference.txt",
            "markup-lists.txt", "prose-en.txt", "multilingual.txt"} <= names
    assert 50_000 < sum(f.stat().st_size for f in files) < 400_000  # "a few hundred KB at most"
    readme = (corpus.default_data_dir().parent / "README.md").read_text()
    for n in names:  # every file is named with its source and licence
        row = next((line for line in readme.splitlines() if f"`{n}`" in line), "")
        assert re.search(r"public domain|PSF License|Apache-2.0", row), n
    # the package data globs of pyproject.toml cover the set and its README (a wheel ships them)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["devin_compile.quant"]
    pkg = ROOT / "devin_compile" / "quant"
    for f in files + [corpus.default_data_dir().parent / "README.md"]:
        assert any(fnmatch(str(f.relative_to(pkg)), g) for g in globs), f
    multilingual = (corpus.default_data_dir() / "multilingual.txt").read_text()
    assert all(w in multilingual for w in ("Bibliothek", "mercado", "logiciel"))


def test_default_stream_interleaves_every_document():
    tok = CharTokenizer()
    stream = corpus.load_token_stream(tok)
    docs = [torch.tensor(tok(corpus.read_text(f))["input_ids"]) for f in corpus.source_files()]
    assert stream.numel() == sum(d.numel() for d in docs)
    # the first len(docs) blocks are the first block of each document, in path order
    for i, d in enumerate(docs):
        assert torch.equal(stream[i * 512:(i + 1) * 512], d[:512])


def test_interleave_round_robin_until_each_runs_out():
    a, b = torch.arange(0, 5), torch.arange(100, 102)
    assert corpus.interleave([a, b], block=2).tolist() == [0, 1, 100, 101, 2, 3, 4]


# ---------------------------------------------------------------- data= forms
def test_files_folders_and_lists(tmp_path):
    tok = CharTokenizer()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("bbbb")
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "c.md").write_text("cc")
    (tmp_path / "d" / ".hidden").write_text("never read")
    (tmp_path / "a.txt").write_text("aaaaaa")
    assert [f.name for f in corpus.source_files(tmp_path / "d")] == ["b.txt", "c.md"]
    files = corpus.source_files([str(tmp_path / "a.txt"), tmp_path / "d"])
    assert [f.name for f in files] == ["a.txt", "b.txt", "c.md"]
    stream = corpus.load_token_stream(tok, [tmp_path / "a.txt", tmp_path / "d"], block=2)
    decoded = "".join(chr(i - 3) for i in stream.tolist())
    assert decoded == "aabbccaabbaa"
    label = corpus.data_label([tmp_path / "a.txt", tmp_path / "d"])
    assert corpus.data_from_label(label) == [str(f) for f in files]
    assert corpus.data_from_label(corpus.data_label(None)) is None


def test_bad_data_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        corpus.source_files(tmp_path / "nope.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no files"):
        corpus.source_files(tmp_path / "empty")
    with pytest.raises(ValueError, match="empty list"):
        corpus.source_files([])
    (tmp_path / "w.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="not a text file"):
        corpus.load_token_stream(CharTokenizer(), tmp_path / "w.bin")
    with pytest.raises(ValueError, match="must be a path"):
        QuantConfig(data=[1, 2])
    with pytest.raises(ValueError, match="progress"):
        QuantConfig(progress="yes")
    monkeypatch.setenv("DEVIN_COMPILE_DATA", str(tmp_path / "a.txt"))
    (tmp_path / "a.txt").write_text("x" * 50)
    assert corpus.source_files() == [tmp_path / "a.txt"]


def test_calibrate_defaults_to_the_shipped_set(tiny):
    stats = quant.calibrate(tiny, CharTokenizer(), num_chunks=2, chunk_len=32, progress=False, fisher=False)
    assert stats.data == corpus.DEFAULT_LABEL and stats.tokens == 64


def test_cli_help_quotes_the_config_defaults():
    import argparse

    from devin_compile.cli import quantize as cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    run = p._subparsers._group_actions[0].choices["run"]
    damp = next(a for a in run._actions if a.dest == "damp")
    assert f"(default {QuantConfig().damp})" in damp.help and damp.default is None
