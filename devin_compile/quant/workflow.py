"""The quantization steps as one call each: :func:`calibrate`, :func:`quantize`, and
:func:`quantize_for_optimize` (what ``optimize(model, quantization={...})`` runs)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .calibration import CalibrationStats, collect_stats, load_token_stream, token_chunks
from .config import QuantConfig
from .kl_search import resolve_max_kl
from .quantize import quantize_model
from .result import QuantResult


def calibrate(model: torch.nn.Module, tokenizer, data: str | None = None, num_chunks: int = 16, chunk_len: int = 512,
              progress: Callable[[int, int], None] | None = None, fisher: bool = True) -> CalibrationStats:
    """Activation statistics of ``model`` on the first ``num_chunks x chunk_len`` tokens of ``data``
    (and its output-gradient statistics unless ``fisher=False``: see :mod:`.calibration`)."""
    stream = load_token_stream(tokenizer, data)
    chunks = token_chunks(stream, num_chunks, chunk_len)
    return collect_stats(model, chunks, progress=progress, data=str(data or "tinyshakespeare (default)"),
                         fisher=fisher)


def quantize(model: torch.nn.Module, stats: CalibrationStats, progress=None, **options: Any) -> QuantResult:
    """Quantize every decoder linear (options: :class:`QuantConfig` keys)."""
    return quantize_model(model, stats, QuantConfig.coerce(options), progress=progress)


def quantize_for_optimize(model: torch.nn.Module, tokenizer, qcfg: QuantConfig) -> QuantResult:
    """What ``optimize(model, quantization={...})`` runs: calibrate on ``qcfg.data`` and quantize."""
    if tokenizer is None:
        raise ValueError("optimize(quantization=...) calibrates on text, so it needs tokenizer= "
                         "(or quantize beforehand and pass quantized='dir/')")
    stream = load_token_stream(tokenizer, qcfg.data)
    chunks = token_chunks(stream, qcfg.calib_chunks, qcfg.calib_len)
    stats = collect_stats(model, chunks, data=str(qcfg.data or "tinyshakespeare (default)"))
    result = quantize_model(model, stats, qcfg)
    resolve_target(model, result, qcfg, chunks)
    return result


def resolve_target(model: torch.nn.Module, result: QuantResult, qcfg: QuantConfig, chunks) -> None:
    """A ``max_kl`` target becomes ``keep_fp=N`` (measured on ``chunks``, at most 2 of them), in
    ``qcfg`` and in the result's saved config."""
    if qcfg.target["kind"] == "max_kl":
        qcfg.target = resolve_max_kl(model, result, chunks[:2], qcfg.target["value"])
        result.config["target"] = qcfg.target
