"""Calibration and evaluation text: where it comes from and how it becomes token chunks.

Sources (``data=`` in Python, ``--data`` on the CLI): ``None`` is the calibration set shipped
inside the package (``quant/data/calibration/``: prose, dialogue, technical reference, code,
lists/markup and five languages; sources and licences in ``quant/data/README.md``), or the
file/folder named by ``DEVIN_COMPILE_DATA``. Otherwise a file, a folder (every non-hidden
file under it, recursively, in path order) or a list of files and folders.

Every file is one document, tokenized on its own (no special tokens). Several documents are
interleaved in blocks of ``block`` tokens (512), round robin in path order, so any stretch at
the start of the stream mixes every document, and so does any stretch at its end:
calibration takes chunks from the start (:func:`token_chunks`) and evaluation from the end
(``from_end=True``), which never overlap while both fit (:func:`calibration_and_eval_chunks`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

import torch

DataArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]], None]
DEFAULT_LABEL = "default calibration set (devin_compile/quant/data/calibration)"
BLOCK = 512


def default_data_dir() -> Path:
    """The calibration set shipped inside the package."""
    return Path(__file__).resolve().parent / "data" / "calibration"


def source_files(data: DataArg = None) -> list[Path]:
    """The text files ``data`` names (see the module doc), in a stable order; a missing path, an
    empty folder or a non-text file is an error naming it."""
    if data is None:
        env = os.environ.get("DEVIN_COMPILE_DATA")
        data = env.split(os.pathsep) if env else default_data_dir()
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if not items:
        raise ValueError("data= is an empty list: give a text file, a folder of text files, or several of them")
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise FileNotFoundError(f"calibration/evaluation folder {p} has no files (give a folder of text files)")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"calibration/evaluation text {p} does not exist (give --data FILE or FOLDER)")
    return files


def data_label(data: DataArg) -> str:
    """What ``data`` was, for saved metadata: the default set's label, or the paths joined by ``os.pathsep``."""
    if data is None and not os.environ.get("DEVIN_COMPILE_DATA"):
        return DEFAULT_LABEL
    return os.pathsep.join(str(p) for p in source_files(data))


def data_from_label(label: str) -> DataArg:
    """The inverse of :func:`data_label` where the files still exist (else the default set)."""
    if not label or label == DEFAULT_LABEL:
        return None
    paths = label.split(os.pathsep)
    return paths if all(Path(p).is_file() for p in paths) else None


def read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise ValueError(f"{path} is not a text file (it contains NUL bytes); give text files as calibration data")
    return raw.decode("utf-8", errors="replace")


def interleave(streams: Sequence[torch.Tensor], block: int = BLOCK) -> torch.Tensor:
    """Round-robin blocks of ``block`` tokens from each stream until all are used up."""
    pieces, offset = [], 0
    while True:
        live = [s[offset: offset + block] for s in streams if s.numel() > offset]
        if not live:
            break
        pieces.extend(live)
        offset += block
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def load_token_stream(tokenizer, data: DataArg = None, block: int = BLOCK) -> torch.Tensor:
    """Every document of ``data`` tokenized and interleaved into one int64 token stream."""
    streams = []
    for f in source_files(data):
        ids = tokenizer(read_text(f), add_special_tokens=False)["input_ids"]
        if ids:
            streams.append(torch.tensor(ids, dtype=torch.long))
    if not streams:
        raise ValueError(f"calibration/evaluation data {data_label(data)} has no text")
    return interleave(streams, block)


def token_chunks(stream: torch.Tensor, num_chunks: int, chunk_len: int, *, from_end: bool = False,
                 what: str = "calibration") -> list[torch.Tensor]:
    """``num_chunks`` consecutive chunks of ``chunk_len`` tokens from the start (or the end) of
    ``stream``. Too short a stream is a ``ValueError`` saying how many tokens are needed."""
    if num_chunks < 1 or chunk_len < 2:
        raise ValueError(f"{what}: need num_chunks >= 1 and chunk_len >= 2, got {num_chunks} x {chunk_len}")
    need = num_chunks * chunk_len
    if stream.numel() < need:
        raise ValueError(f"{what} text is too short: {num_chunks} chunks of {chunk_len} tokens need {need} "
                         f"tokens, the text has {stream.numel()}; give more --data or fewer chunks")
    base = stream.numel() - need if from_end else 0
    return [stream[base + i * chunk_len: base + (i + 1) * chunk_len] for i in range(num_chunks)]


def calibration_and_eval_chunks(stream: torch.Tensor, calib: tuple[int, int], evaluation: tuple[int, int]):
    """Disjoint calibration (start) and evaluation (end) chunks; an error if they would overlap."""
    need = calib[0] * calib[1] + evaluation[0] * evaluation[1]
    if stream.numel() < need:
        raise ValueError(f"text is too short for disjoint slices: {calib[0]}x{calib[1]} calibration + "
                         f"{evaluation[0]}x{evaluation[1]} evaluation tokens need {need}, the text has {stream.numel()}")
    return (token_chunks(stream, *calib), token_chunks(stream, *evaluation, from_end=True, what="evaluation"))
