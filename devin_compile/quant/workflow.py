"""The quantization steps as one call each: :func:`calibrate`, :func:`quantize`, and
:func:`quantize_for_optimize` (what ``optimize(model, quantization={...})`` runs)."""
from __future__ import annotations

from typing import Any

import torch

from .calibration import CalibrationStats, collect_stats
from .corpus import DataArg, data_label, load_token_stream, token_chunks
from .progress import ProgressArg, stage
from .config import QuantConfig
from .kl_search import resolve_max_kl
from .quantize import quantize_model
from .result import QuantResult


def calibrate(model: torch.nn.Module, tokenizer, data: DataArg = None, num_chunks: int = 16, chunk_len: int = 512,
              progress: ProgressArg = True, fisher: bool = True) -> CalibrationStats:
    """Activation statistics of ``model`` on the first ``num_chunks x chunk_len`` tokens of ``data``
    (default: the calibration set shipped in the package; a file, a folder or a list: :mod:`.corpus`)
    and its output-gradient statistics unless ``fisher=False`` (:mod:`.calibration`).
    ``progress``: True log lines (logger ``devin_compile.quant``), False silent, or a callable
    (:mod:`.progress`)."""
    stream = load_token_stream(tokenizer, data)
    chunks = token_chunks(stream, num_chunks, chunk_len)
    return collect_stats(model, chunks, progress=progress, data=data_label(data), fisher=fisher)


def quantize(model: torch.nn.Module, stats: CalibrationStats, progress: ProgressArg = None,
             **options: Any) -> QuantResult:
    """Quantize every decoder linear (options: :class:`QuantConfig` keys; ``progress`` defaults to
    the ``progress`` option, True)."""
    return quantize_model(model, stats, QuantConfig.coerce(options), progress=progress)


def quantize_for_optimize(model: torch.nn.Module, tokenizer, qcfg: QuantConfig) -> QuantResult:
    """What ``optimize(model, quantization={...})`` runs: calibrate on ``qcfg.data`` and quantize."""
    if tokenizer is None:
        raise ValueError("optimize(quantization=...) calibrates on text, so it needs tokenizer= "
                         "(or quantize beforehand and pass quantized='dir/')")
    stream = load_token_stream(tokenizer, qcfg.data)
    chunks = token_chunks(stream, qcfg.calib_chunks, qcfg.calib_len)
    stats = collect_stats(model, chunks, data=data_label(qcfg.data), progress=qcfg.progress)
    result = quantize_model(model, stats, qcfg)
    resolve_target(model, result, qcfg, chunks)
    return result


def resolve_target(model: torch.nn.Module, result: QuantResult, qcfg: QuantConfig, chunks) -> None:
    """A ``max_kl`` target becomes ``keep_fp=N`` (measured on ``chunks``, at most 2 of them), in
    ``qcfg`` and in the result's saved config."""
    if qcfg.target["kind"] == "max_kl":
        stage(qcfg.progress, f"resolving target max_kl={qcfg.target['value']} on {len(chunks[:2])} calibration chunks")
        qcfg.target = resolve_max_kl(model, result, chunks[:2], qcfg.target["value"])
        result.config["target"] = qcfg.target
