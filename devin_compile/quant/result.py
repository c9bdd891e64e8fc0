"""What quantization produces: :class:`QLinear` per decoder linear, gathered in a :class:`QuantResult`,
and :func:`sensitivity`, the ranking of linears that mixed precision and ``max_kl`` use."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.int4 import format as fmt


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
    loss_delta: float | None = None  # ½ Σ_j fisher_j (ΔW H ΔWᵀ)_jj: estimated next-token loss increase (nats)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

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
    head: str | None = None  # the output head's module name when it is quantized too (lm_head=True)


def sensitivity(result: QuantResult, groups: list[list[str]]) -> tuple[list[float], str]:
    """Per group of linears (computed by one graph linear): the estimated loss increase when
    that group alone is quantized, if every linear of ``result`` has one (calibration with
    output-gradient statistics), else the relative output error. Returns (values, kind)."""
    lins = result.linears
    if all(ql.loss_delta is not None for ql in lins.values()):
        return [sum(lins[n].loss_delta for n in g) for g in groups], "loss"
    return [sum(lins[n].err for n in g) / max(1e-30, sum(lins[n].signal for n in g)) for g in groups], "relative"
