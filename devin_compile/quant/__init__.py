"""Weight-only INT4 (and FP8) quantization: calibrate → quantize → validate.

Python API (the CLI ``devin-compile quantize calibrate|run|validate`` wraps these)::

    from devin_compile import quant
    stats = quant.calibrate(model, tok)                       # the shipped set, 16 x 512 tokens
    stats.save("calib/")                                      # stats.safetensors + calib.json
    result = quant.quantize(model, stats, method="awq", group_size=64)
    quant.save(result, "q/")                                  # quantized.safetensors + quant_config.json
    opt = devin_compile.optimize(model, tokenizer=tok, quantized="q/")
    report = quant.validate(model, tok, "q/", optimize=devin_compile.optimize)  # ppl, KL, top-1, bytes, layers

Modules: ``config`` (QuantConfig, targets), ``calibration``, ``awq``, ``gptq``, ``quantize``
(RTN/AWQ/GPTQ over every decoder linear), ``corpus`` (data sources, chunks), ``progress``,
``result`` (QuantResult, sensitivity), ``precision`` (which tier each linear gets: INT4, FP8 or
the model dtype; the byte-budget knapsack), ``simulation``
(the eager equivalent), ``kl_search`` (``max_kl`` targets), ``workflow`` (one call per step),
``artifact`` (save/load), ``evaluate`` (quality metrics, validate). The INT4 format itself is
``devin_compile.backends.int4.format``.
"""
from __future__ import annotations

from .artifact import load, save
from .calibration_stats import CalibrationStats
from .config import METHODS, RUNTIME_KEYS, TIERS, QuantConfig, parse_target, parse_tiers
from .evaluate import validate
from .kl_search import resolve_max_kl
from .quantize import quantize_model
from .precision import choose_tiers, knapsack
from .result import QLinear, QuantResult, has_fp8, sensitivity
from .simulation import simulate, untie_head
# last: ``quant.quantize`` is the function, not the submodule of the same name
from .workflow import calibrate, quantize, quantize_for_optimize, resolve_target

__all__ = ["CalibrationStats", "QuantConfig", "QuantResult", "calibrate", "quantize", "save", "load", "simulate",
           "validate", "quantize_for_optimize", "resolve_target", "resolve_max_kl", "quantize_model", "parse_target",
           "sensitivity", "untie_head", "QLinear", "METHODS", "RUNTIME_KEYS", "TIERS", "parse_tiers", "choose_tiers",
           "knapsack", "has_fp8"]
