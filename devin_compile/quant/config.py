"""Quantization options: :class:`QuantConfig` (validated when built) and the target syntax.

``optimize(model, quantization={...})`` and ``devin-compile quantize run`` take the same keys.
A target says which linears end up INT4 (``all``, ``keep_fp=N``, ``int4_fraction=F``,
``memory_bytes=B``, ``memory_fraction=F``, ``keep=NAMES``, ``max_kl=X``); ``tiers`` which
precisions below the model dtype may be used (``int4``, ``fp8``: the byte-budget targets choose
among them per linear);
:data:`RUNTIME_KEYS` are the keys that only steer how an already quantized model is compiled.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..backends.int4 import format as fmt
from .progress import check_progress
from ..validation import flag, from_mapping, int_at_least, number_in, one_of, positive_int

METHODS = ("rtn", "awq", "gptq")
TARGET_KINDS = ("all", "keep_fp", "int4_fraction", "memory_bytes", "memory_fraction", "keep", "max_kl")
INT4_KERNELS = ("auto", "cpu", "cpu_c", "reference", "triton")
# Keys that only steer how an already quantized model is compiled; the rest fix the weights.
RUNTIME_KEYS = ("target", "kernel", "max_int4_tokens", "dense_prefill", "progress", "tiers")
# The runtime keys that say how this machine runs the weights: an artifact's saved values for them are
# not inherited when it is loaded (the caller's, or this machine's defaults, apply).
MACHINE_KEYS = ("kernel", "max_int4_tokens", "dense_prefill")
# Precision tiers below the model dtype a linear may take (the model dtype is always a choice).
TIERS = ("int4", "fp8")
# The options that shape how one linear is rounded: what a ``per_linear`` override may set.
PER_LINEAR_KEYS = ("damp", "loss_weight", "act_order", "anchors", "clip", "refits")
# The MLP's input projections under the names Hugging Face families give them (Llama/Qwen/Mistral gate
# and up, Phi-3's fused gate_up, OPT/Phi fc1, GPT-2/StarCoder c_fc, GPT-J fc_in, GPT-NeoX/Falcon
# dense_h_to_4h, Mixtral experts' w1/w3), matched against a linear's qualified name.
MLP_INPUT = r"(^|\.)(gate_proj|up_proj|gate_up_proj|fc1|c_fc|fc_in|dense_h_to_4h|w1|w3)$"
# Each method's default ``per_linear``: GPTQ rounds the MLP's input projections on the activation
# Hessian alone, damped more. The blended objective (loss_weight 2) is what took v_proj's held-out
# loss down, but on gate/up it fits the calibration's output gradients and costs held-out text, as
# light dampening does; AWQ's scale search is the other way round (README: "Per-linear options").
DEFAULT_PER_LINEAR = {"gptq": {MLP_INPUT: {"loss_weight": 0.0, "damp": 0.5}}}


def parse_tiers(value: Any) -> tuple[str, ...]:
    """``"int4,fp8"``, ``["fp8"]`` … → a tuple in :data:`TIERS` order; a ``ValueError`` naming the choices."""
    names = [t.strip() for t in value.split(",")] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(t, str) for t in names) \
            or set(names) - set(TIERS):
        raise ValueError(f"quantization tiers={value!r} is invalid; give a non-empty subset of {list(TIERS)} "
                         "(e.g. 'int4,fp8'; the model dtype is always a choice)")
    return tuple(t for t in TIERS if t in names)


def parse_target(value: Any) -> dict:
    """``"all"``, ``"keep_fp=4"``, ``{"int4_fraction": 0.8}``, ``{"memory_bytes": 5e7}`` … →
    ``{"kind": ..., "value": ...}``; anything else is a ``ValueError`` naming the choices."""
    if value is None or value == "all" or value == {"kind": "all"}:
        return {"kind": "all", "value": None}
    if isinstance(value, Mapping) and set(value) == {"kind", "value"}:  # the normalised form itself
        if value["kind"] == "all":
            return {"kind": "all", "value": None}
        value = {value["kind"]: value["value"]}
    if isinstance(value, str) and "=" in value:
        k, _, v = value.partition("=")
        value = {k.strip(): v.strip()}
    if isinstance(value, Mapping) and len(value) == 1:
        (kind, v), = value.items()
        parsed = _parse_target_value(kind, v)
        if parsed is not None:
            return {"kind": kind, "value": parsed}
        if kind in TARGET_KINDS:
            raise ValueError(f"quantization target {kind}={v!r} is out of range (keep_fp: integer >= 0; "
                             "int4_fraction/memory_fraction: in (0, 1]; memory_bytes, max_kl: > 0; keep: linear names)")
    raise ValueError(f"quantization target {value!r} is unknown; valid: 'all', or one of "
                     f"{[k for k in TARGET_KINDS if k != 'all']} as 'kind=value' or {{kind: value}}")


def _parse_target_value(kind: str, v: Any) -> Any:
    """The normalised value of a ``kind=v`` target, or None when ``v`` is out of range or ``kind`` unknown."""
    try:
        if kind == "keep_fp":
            n = int(v)
            return n if n >= 0 else None
        if kind == "max_kl":
            f = float(v)
            return f if f > 0 else None
        if kind in ("int4_fraction", "memory_fraction"):
            f = float(v)
            return f if 0.0 < f <= 1.0 else None
        if kind == "memory_bytes":
            b = int(float(v))
            return b if b > 0 else None
        if kind == "keep":  # explicit: these linears (HF names) stay unquantized
            names = [x.strip() for x in v.split(",")] if isinstance(v, str) else list(v)
            return sorted(set(names)) if all(isinstance(x, str) and x for x in names) else None
    except (TypeError, ValueError):
        pass
    return None


@dataclass
class QuantConfig:
    """``optimize(model, quantization={...})`` / ``devin-compile quantize run`` options."""

    method: str = "awq"
    bits: int = 4
    group_size: int = 64
    target: Any = "all"
    act_order: bool = True  # GPTQ: visit columns by decreasing Hessian diagonal (static groups)
    damp: float = 0.1  # GPTQ: dampening, a fraction of mean(diag H) (raised if Cholesky fails); see gptq.py
    clip: bool = True  # AWQ: clipping search; GPTQ: static groups on the clipping search's grid
    # GPTQ/AWQ: rounds of least-squares refits of every group's scale and min to its codes (quant/grid_refit.py);
    # GPTQ re-runs on each refitted grid but the last, AWQ re-rounds to nearest on it (0: off)
    refits: int = 2
    # GPTQ/AWQ objective: H/mean diag H + loss_weight · H_g/mean diag H_g (H_g: the gradient-weighted input
    # Hessian of calibration with output gradients; 0 or no H_g: H alone); see quantize.py
    loss_weight: float = 2.0
    # per linear, the groups of this many strongest input channels get a grid on which that channel's
    # weight is exact (quant/anchor.py; 0: off, the default since the clipping search moves each end
    # of a group's range on its own, which does better on held-out text: README)
    anchors: int = 0
    calib_chunks: int = 16
    calib_len: int = 512
    # calibration text: a file, a folder or a list of them (default: the set shipped in the package)
    data: Any = None
    kernel: str = "auto"  # auto: "cpu_c" on CPU (aten's "cpu" without a C compiler), "triton" on CUDA
    max_int4_tokens: int | None = None  # steps above this many tokens leave the INT4 kernel for a dense GEMM
    # steps above max_int4_tokens / max_fp8_tokens: True reads a dense (dequantized) copy of each quantized
    # weight kept for the model's life (speed for memory); False dequantizes tiles of it into a reused buffer
    # per step (the C kernels; aten's "cpu" kernel has no tiles and runs every step); None: False wherever
    # the tiles exist, True for aten's "cpu" kernel (the fallback without a C compiler)
    dense_prefill: bool | None = None
    # the output head (lm_head): "int8" (the default: symmetric INT8, one scale a row, outside the target and
    # the tiers), "int4" (True: quantized like the decoder linears, a candidate of the target), or False (kept
    # in the model dtype). A tied embedding reads the quantized head's rows (devin::int8_embedding /
    # int4_embedding), so no dense table is kept: SmolLM2 fp32 INT4 holds 0.33x its parameter bytes with the
    # INT8 head, 0.31x with the INT4 one, 0.49x with the head kept (docs/benchmarks.md#memory)
    lm_head: Any = "int8"
    # calibration and the per-layer loops: True log lines (logger devin_compile.quant, INFO), False silent,
    # or a callable fn(done, total, *info) (quant/progress.py); not part of the config's identity
    progress: Any = dataclasses.field(default=True, repr=False, compare=False)
    # precision tiers below the model dtype: "int4" and/or "fp8" (e4m3, per-row scales); byte-budget
    # targets pick each linear's tier by a knapsack over the estimated loss (passes/assign_precision/)
    tiers: Any = ("int4",)
    # {regex: {option: value}}: the linears whose qualified name the regex matches (re.search; the first
    # matching regex wins) are rounded with these PER_LINEAR_KEYS options instead of the ones above
    # (None: the method's DEFAULT_PER_LINEAR; {}: none)
    per_linear: Any = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization method {self.method!r} is unsupported; valid: {list(METHODS)}")
        one_of("quantization bits", self.bits, fmt.SUPPORTED_BITS, "is unsupported")
        one_of("quantization group_size", self.group_size, fmt.SUPPORTED_GROUP_SIZES, "is unsupported")
        self.target = parse_target(self.target)
        self.tiers = parse_tiers(self.tiers)
        one_of("quantization kernel", self.kernel, INT4_KERNELS)
        int_at_least("max_int4_tokens", self.max_int4_tokens, 0, optional=True)
        if self.dense_prefill is not None:
            flag("dense_prefill", self.dense_prefill)
        self.lm_head = parse_head(self.lm_head)
        check_progress(self.progress, "quantization progress")
        if self.data is not None and not isinstance(self.data, (str, os.PathLike)) and not (
                isinstance(self.data, (list, tuple)) and self.data
                and all(isinstance(d, (str, os.PathLike)) for d in self.data)):
            raise ValueError(f"quantization data={self.data!r} must be a path (file or folder) or a non-empty "
                             "list of paths")
        check_rounding_options({k: getattr(self, k) for k in PER_LINEAR_KEYS})
        self.per_linear = parse_per_linear(DEFAULT_PER_LINEAR.get(self.method, {}) if self.per_linear is None
                                           else self.per_linear)
        positive_int("calib_chunks", self.calib_chunks)
        int_at_least("calib_len", self.calib_len, 2)

    def for_linear(self, name: str) -> "QuantConfig":
        """The options ``name`` is rounded with: this config, with the first ``per_linear`` match applied."""
        for pattern, opts in self.per_linear.items():
            if re.search(pattern, name):
                return dataclasses.replace(self, per_linear={}, **opts)
        return self

    @classmethod
    def coerce(cls, value: Any) -> "QuantConfig | None":
        """None → None; a QuantConfig as it is; a dict → a validated QuantConfig (unknown keys rejected)."""
        if value is None:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return from_mapping(cls, value, "quantization")
        raise ValueError(f"quantization={value!r} must be a dict such as "
                         "{'method': 'awq', 'bits': 4, 'group_size': 64}")


HEAD_CHOICES = ("int8", "int4", False)


def parse_head(value: Any) -> str | bool:
    """``lm_head``: "int8" | "int4" (also True) | False (also None, "none", "fp": kept in the model dtype)."""
    if value is True:
        return "int4"
    if value is None or value is False or value in ("none", "fp"):
        return False
    if value in ("int8", "int4"):
        return value
    raise ValueError(f"quantization lm_head={value!r} is unsupported; valid: 'int8' (the default: INT8, one "
                     "scale a row), 'int4' or True (INT4, like the decoder linears), False (kept in the model dtype)")


def check_rounding_options(opts: Mapping[str, Any], prefix: str = "") -> None:
    """Validate :data:`PER_LINEAR_KEYS` values (any subset); the error names the option as ``prefix + key``."""
    checks = {"damp": lambda n, v: number_in(n, v, 0, 1, lo_open=True, hi_open=True),
              "loss_weight": lambda n, v: number_in(n, v, 0, 100),
              "anchors": lambda n, v: int_at_least(n, v, 0), "act_order": flag, "clip": flag,
              "refits": lambda n, v: int_at_least(n, v, 0)}
    for k, v in opts.items():
        checks[k](prefix + k, v)


def parse_per_linear(value: Any) -> dict[str, dict[str, Any]]:
    """``{regex: {option: value}}`` → the same, validated (each regex compiles, options in
    :data:`PER_LINEAR_KEYS` with valid values)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"quantization per_linear={value!r} must be a dict {{regex on linear names: {{option: value}}}}, "
                         f"e.g. {{'mlp\\.up_proj$': {{'damp': 0.5}}}}; options: {list(PER_LINEAR_KEYS)}")
    out = {}
    for pattern, opts in value.items():
        try:
            re.compile(pattern)
        except (TypeError, re.error) as e:
            raise ValueError(f"quantization per_linear key {pattern!r} is not a regular expression ({e})") from None
        if not isinstance(opts, Mapping):
            raise ValueError(f"quantization per_linear[{pattern!r}]={opts!r} must be a dict of options "
                             f"from {list(PER_LINEAR_KEYS)}")
        unknown = sorted(set(opts) - set(PER_LINEAR_KEYS))
        if unknown:
            raise ValueError(f"quantization per_linear[{pattern!r}] got unknown options {unknown}; "
                             f"valid: {list(PER_LINEAR_KEYS)}")
        check_rounding_options(opts, f"quantization per_linear[{pattern!r}] ")
        out[pattern] = dict(opts)
    return out
