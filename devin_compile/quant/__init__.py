"""Weight-only INT4 quantization: calibrate → quantize → validate.

Python API (the CLI ``devin-compile quantize calibrate|run|validate`` wraps these)::

    from devin_compile import quant
    stats = quant.calibrate(model, tok)                       # tinyshakespeare, 16 x 512 tokens
    stats.save("calib/")                                      # stats.safetensors + calib.json
    result = quant.quantize(model, stats, method="awq", group_size=64)
    quant.save(result, "q/")                                  # quantized.safetensors + quant_config.json
    opt = devin_compile.optimize(model, tokenizer=tok, quantized="q/")
    report = quant.validate(model, tok, "q/")                 # perplexity, KL, top-1, bytes, per-layer table

Modules: :mod:`.int4` (the format), :mod:`.calibration`, :mod:`.awq`, :mod:`.gptq`,
:mod:`.quantize` (RTN and the driver), :mod:`.artifact` (save/load), :mod:`.evaluate`.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .artifact import load, save
from .calibration import CalibrationStats, collect_stats, load_token_stream, token_chunks
from .quantize import QuantConfig, QuantResult, quantize_model, resolve_max_kl, simulate

__all__ = ["CalibrationStats", "QuantConfig", "QuantResult", "calibrate", "quantize", "save", "load", "simulate",
           "validate", "quantize_for_optimize"]


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


def validate(model: torch.nn.Module, tokenizer, quantized: str, data: str | None = None, num_chunks: int = 16,
             chunk_len: int = 512, **optimize_options: Any) -> dict:
    """Perplexity (fixed ``chunk_len`` chunks from the end of ``data``), KL vs the unquantized
    model over the full vocabulary, top-1 agreement, weight bytes and the per-layer table."""
    from ..api import optimize
    from .evaluate import compare, hf_logits_fn, optimized_logits_fn, reference_logits

    stream = load_token_stream(tokenizer, data)
    chunks = token_chunks(stream, num_chunks, chunk_len, from_end=True, what="evaluation")
    t0 = time.perf_counter()
    opt = optimize(model, tokenizer=tokenizer, quantized=quantized, **optimize_options)
    compile_s = time.perf_counter() - t0
    ref = reference_logits(hf_logits_fn(model), chunks)
    quality = compare(optimized_logits_fn(opt), chunks, ref)
    table = opt.precision_table
    return {"quantized": str(quantized), "quality": quality.as_dict(), "chunks": num_chunks, "chunk_len": chunk_len,
            "int4_bytes_total": sum(r["bytes"] for r in table),
            "fp_bytes_total": sum(r["params"] for r in table) * next(model.parameters()).element_size(),
            "compile_seconds": compile_s, "layers": table, "pass_note": opt.quant_note}
