"""What quantization produces: :class:`QLinear` per decoder linear, gathered in a :class:`QuantResult`,
and :func:`sensitivity`, the ranking of linears that mixed precision and ``max_kl`` use."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..backends.fp8 import format as fp8_fmt
from ..backends.int4 import format as fmt
from ..backends.int8 import format as int8_fmt


@dataclass
class QLinear:
    """One decoder linear, quantized (the logical format of :mod:`devin_compile.backends.int4.format`)."""

    q: torch.Tensor  # uint8 [N, K]
    scale: torch.Tensor  # fp32 [N, G]
    minv: torch.Tensor  # fp32 [N, G]
    group_size: int
    group_note: str  # why group_size differs from the requested one ("" if it does not)
    err: float  # tr(ΔW H ΔWᵀ): mean squared output error on the calibration tokens
    signal: float  # tr(W H Wᵀ)
    in_scale: torch.Tensor | None = None  # AWQ: the quantized weight is W · diag(in_scale)
    row_scale: torch.Tensor | None = None  # AWQ: ... and diag(row_scale) · W (a fold from the next linear)
    loss_delta: float | None = None  # ½ Σ_j fisher_j (ΔW H_g ΔWᵀ)_jj: estimated next-token loss increase (nats)
    # the FP8 tier (tiers including "fp8"): e4m3 codes and row scales of the same (AWQ-folded) weight,
    # and its output error and estimated loss increase, as err / loss_delta are for INT4
    fp8_q: torch.Tensor | None = None  # uint8 [N, K] (backends.fp8.format)
    fp8_scale: torch.Tensor | None = None  # fp32 [N]
    fp8_err: float | None = None
    fp8_loss_delta: float | None = None
    dims: tuple[int, int] | None = None  # [N, K] once the tensors are released (QuantResult.without_tensors)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape) if self.q is not None else self.dims

    @property
    def embedding_readable(self) -> bool:
        """Whether a tied embedding can read this (head's) dequantized rows: no row scale folded in (an AWQ input
        scale is undone per column: :attr:`embedding_col_scale`)."""
        return self.row_scale is None

    @property
    def embedding_col_scale(self) -> torch.Tensor | None:
        """float32 [K] that turns a dequantized row back into the weight's row (``1 / in_scale``), or None."""
        return None if self.in_scale is None else 1.0 / self.in_scale.float()

    def embedding_rows(self) -> torch.Tensor:
        """The rows a tied embedding reads (float32 [N, K]): what ``devin::int4_embedding`` computes."""
        rows = self.dequantized(torch.float32)
        scale = self.embedding_col_scale
        return rows if scale is None else rows * scale[None, :]

    def fp_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The full-precision weight this linear must use when kept unquantized (AWQ folded
        scales into its input producer, so the original ``w`` no longer applies)."""
        out = w.float()
        if self.in_scale is not None:
            out = out * self.in_scale[None, :]
        if self.row_scale is not None:
            out = out * self.row_scale[:, None]
        return out.to(w.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fmt.dequantize(self.q, self.scale, self.minv, self.group_size, dtype)

    def fp8_dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fp8_q is None:
            raise ValueError("this linear has no FP8 weight (quantized without the fp8 tier)")
        return fp8_fmt.dequantize(self.fp8_q, self.fp8_scale, dtype)


@dataclass
class Int8Head:
    """The output head in INT8 (``lm_head="int8"``; :mod:`devin_compile.backends.int8.format`): symmetric
    per-row rounding of its weight, outside the target's choice. ``err``/``signal``/``loss_delta`` as for a
    :class:`QLinear` (None when the calibration has no statistics of the head's input)."""

    name: str  # HF module name (lm_head)
    q: torch.Tensor | None  # int8 [N, K] (None once released: QuantResult.without_tensors)
    scale: torch.Tensor | None  # fp32 [N]
    dims: tuple[int, int]
    err: float | None = None
    signal: float | None = None
    loss_delta: float | None = None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return int8_fmt.dequantize(self.q, self.scale, dtype)


@dataclass
class QuantResult:
    method: str
    bits: int
    group_size: int  # requested
    linears: dict[str, QLinear]
    overrides: dict[str, torch.Tensor]  # HF parameter name → new value (AWQ-scaled norm weights)
    fingerprint: dict
    config: dict = field(default_factory=dict)  # the QuantConfig it was made with
    seconds: float = 0.0
    calib: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)  # linears sharing one input (fused in the graph)
    head: str | None = None  # the output head's module name when it is an INT4 candidate (lm_head="int4")
    int8_head: Int8Head | None = None  # the output head in INT8 (lm_head="int8")
    tensors_released: bool = False  # a report without weights (without_tensors): nothing to save or simulate

    def without_tensors(self) -> "QuantResult":
        """This result as a report: method, config, notes and every linear's shape, errors and estimated
        losses, without its tensors (what ``optimize()`` keeps: the compiled program holds the weights)."""
        tensor_fields = ("q", "scale", "minv", "in_scale", "row_scale", "fp8_q", "fp8_scale")
        linears = {n: dataclasses.replace(ql, dims=ql.shape, **dict.fromkeys(tensor_fields))
                   for n, ql in self.linears.items()}
        head8 = self.int8_head and dataclasses.replace(self.int8_head, q=None, scale=None)
        return dataclasses.replace(self, linears=linears, overrides={}, int8_head=head8, tensors_released=True)

    def check_tensors(self, what: str) -> None:
        """``ValueError`` naming ``what`` when this result holds no tensors (:meth:`without_tensors`)."""
        if self.tensors_released:
            raise ValueError(f"{what} needs the quantized weights, and this QuantResult holds none: optimize() "
                             "keeps quant_result without its tensors (the program holds the weights); pass "
                             "keep_quant_result=True to optimize(), or quantize with quant.quantize()")


def has_fp8(result: QuantResult) -> bool:
    """Whether every linear of ``result`` carries an FP8 weight (quantized with the fp8 tier)."""
    return bool(result.linears) and all(ql.fp8_q is not None or (result.tensors_released and ql.fp8_err is not None)
                                        for ql in result.linears.values())


def check_tiers(result: QuantResult, tiers: tuple[str, ...], where: str = "the quantized model") -> None:
    """``ValueError`` when ``tiers`` asks for FP8 and ``result`` has no FP8 weights."""
    if "fp8" in tiers and not has_fp8(result):
        raise ValueError(f"quantization tiers {list(tiers)} include 'fp8', but {where} has no FP8 weights: "
                         "quantize with tiers including 'fp8' (`devin-compile quantize run --tiers int4,fp8`)")


def sensitivity(result: QuantResult, groups: list[list[str]], tier: str = "int4") -> tuple[list[float], str]:
    """Per group of linears (computed by one graph linear): the estimated loss increase when
    that group alone is quantized to ``tier`` ("int4" or "fp8"), if every linear of ``result``
    has one (calibration with output-gradient statistics), else the relative output error.
    Returns (values, kind)."""
    lins = result.linears
    if tier == "fp8":
        if not has_fp8(result):
            raise ValueError("the quantized model has no FP8 weights: quantize with tiers including 'fp8'")
        loss = {n: ql.fp8_loss_delta for n, ql in lins.items()}
        err = {n: ql.fp8_err for n, ql in lins.items()}
    else:
        loss = {n: ql.loss_delta for n, ql in lins.items()}
        err = {n: ql.err for n, ql in lins.items()}
    if all(v is not None for v in loss.values()):
        return [sum(loss[n] for n in g) for g in groups], "loss"
    return [sum(err[n] for n in g) / max(1e-30, sum(lins[n].signal for n in g)) for g in groups], "relative"
