"""Quantize a Hugging Face model's decoder linears from calibration statistics.

:class:`QuantConfig` holds (and validates) every quantization option; :func:`quantize_model`
runs RTN, AWQ or GPTQ on every decoder linear (all of them are candidates: which ones end
up INT4 is decided by the ``assign_precision`` pass from the target) and returns a
:class:`QuantResult`: per linear the logical INT4 weight (:mod:`.int4`), its output error
``tr(ΔW H ΔWᵀ)`` and signal ``tr(W H Wᵀ)`` on the calibration tokens (their ratio: the
relative output error when that layer alone is quantized), its estimated loss increase
``½ Σ_j fisher_j (ΔW H ΔWᵀ)_jj`` when the calibration has output-gradient statistics
(:mod:`.calibration`), and for AWQ the scales folded into norms and preceding linears.
:func:`sensitivity` ranks linears for mixed precision: the estimated loss increase when
every linear has one, else the relative output error.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from . import awq, gptq
from ..backends.int4 import format as fmt
from .calibration import CalibrationStats, model_fingerprint, output_head, quantizable_linears

METHODS = ("rtn", "awq", "gptq")
TARGET_KINDS = ("all", "keep_fp", "int4_fraction", "memory_bytes", "memory_fraction", "keep", "max_kl")
INT4_KERNELS = ("auto", "cpu", "cpu_c", "reference", "triton")
# Keys that only steer how an already quantized model is compiled; the rest fix the weights.
RUNTIME_KEYS = ("target", "kernel", "max_int4_tokens", "dense_prefill")


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
        try:
            if kind == "keep_fp":
                n = int(v)
                if n >= 0:
                    return {"kind": kind, "value": n}
            elif kind == "max_kl":
                f = float(v)
                if f > 0:
                    return {"kind": kind, "value": f}
            elif kind in ("int4_fraction", "memory_fraction"):
                f = float(v)
                if 0.0 < f <= 1.0:
                    return {"kind": kind, "value": f}
            elif kind == "memory_bytes":
                b = int(float(v))
                if b > 0:
                    return {"kind": kind, "value": b}
            elif kind == "keep":  # explicit: these linears (HF names) stay unquantized
                names = [x.strip() for x in v.split(",")] if isinstance(v, str) else list(v)
                if all(isinstance(x, str) and x for x in names):
                    return {"kind": kind, "value": sorted(set(names))}
        except (TypeError, ValueError):
            pass
        if kind in TARGET_KINDS:
            raise ValueError(f"quantization target {kind}={v!r} is out of range (keep_fp: integer >= 0; "
                             "int4_fraction/memory_fraction: in (0, 1]; memory_bytes, max_kl: > 0; keep: linear names)")
    raise ValueError(f"quantization target {value!r} is unknown; valid: 'all', or one of "
                     f"{[k for k in TARGET_KINDS if k != 'all']} as 'kind=value' or {{kind: value}}")


@dataclass
class QuantConfig:
    """``optimize(model, quantization={...})`` / ``devin-compile quantize run`` options."""

    method: str = "awq"
    bits: int = 4
    group_size: int = 64
    target: Any = "all"
    act_order: bool = True  # GPTQ: visit columns by decreasing Hessian diagonal (static groups)
    damp: float = 0.01  # GPTQ: dampening as a fraction of mean(diag H) (raised if Cholesky fails)
    clip: bool = True  # AWQ: clipping search; GPTQ: static groups on the clipping search's grid
    calib_chunks: int = 16
    calib_len: int = 512
    data: str | None = None  # calibration text (default: ../shared/data/tinyshakespeare.txt)
    kernel: str = "auto"  # auto: "cpu_c" on CPU (aten's "cpu" without a C compiler), "triton" on CUDA
    max_int4_tokens: int | None = None  # steps above this many tokens use the dense copy
    dense_prefill: bool = True  # keep a dense (dequantized) copy for steps above max_int4_tokens
    # also quantize the output head (lm_head; untied from a tied embedding, which stays in the model dtype)
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization method {self.method!r} is unsupported; valid: {list(METHODS)}")
        if self.bits not in fmt.SUPPORTED_BITS:
            raise ValueError(f"quantization bits={self.bits!r} is unsupported; valid: {list(fmt.SUPPORTED_BITS)}")
        if self.group_size not in fmt.SUPPORTED_GROUP_SIZES:
            raise ValueError(f"quantization group_size={self.group_size!r} is unsupported; "
                             f"valid: {list(fmt.SUPPORTED_GROUP_SIZES)}")
        self.target = parse_target(self.target)
        if self.kernel not in INT4_KERNELS:
            raise ValueError(f"quantization kernel={self.kernel!r} is unknown; valid: {list(INT4_KERNELS)}")
        if self.max_int4_tokens is not None and (not isinstance(self.max_int4_tokens, int) or self.max_int4_tokens < 0):
            raise ValueError(f"max_int4_tokens={self.max_int4_tokens!r} must be an integer >= 0 or None")
        if not isinstance(self.lm_head, bool):
            raise ValueError(f"lm_head={self.lm_head!r} must be True or False")
        if not (isinstance(self.damp, (int, float)) and 0 < self.damp < 1):
            raise ValueError(f"damp={self.damp!r} must be in (0, 1)")
        for name in ("calib_chunks", "calib_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (1 if name == "calib_chunks" else 2):
                raise ValueError(f"{name}={v!r} must be a positive integer")

    @classmethod
    def coerce(cls, value: Any) -> "QuantConfig | None":
        if value is None:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            from ..config import from_mapping

            return from_mapping(cls, value, "quantization")
        raise ValueError(f"quantization={value!r} must be a dict such as "
                         "{'method': 'awq', 'bits': 4, 'group_size': 64}")


@dataclass
class QLinear:
    """One decoder linear, quantized (the logical format of :mod:`.int4`)."""

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


def _fold_source(name: str, linears: dict[str, torch.nn.Linear]) -> str | None:
    """The linear whose output rows feed ``name``'s input channels one to one (v→o, up→down)."""
    parent, _, leaf = name.rpartition(".")
    pred = {"o_proj": "v_proj", "down_proj": "up_proj"}.get(leaf)
    if pred is None:
        return None
    src = f"{parent}.{pred}" if parent else pred
    lin, src_lin = linears[name], linears.get(src)
    if src_lin is None or src_lin.out_features != lin.in_features:
        return None  # e.g. v→o under grouped-query attention: v has fewer rows than o has inputs
    return src


def _is_qk(name: str) -> bool:
    return name.rpartition(".")[2] in ("q_proj", "k_proj")


def quantize_model(model: torch.nn.Module, stats: CalibrationStats, config: QuantConfig | Mapping | None = None,
                   progress: Callable[[int, int, str], None] | None = None) -> QuantResult:
    """Quantize every decoder linear of ``model`` (not modified) with ``config.method``, and the
    output head too with ``lm_head=True`` (its AWQ scale folds into the final norm)."""
    cfg = QuantConfig.coerce(config) if config is not None else QuantConfig()
    t0 = time.perf_counter()
    lins = quantizable_linears(model, cfg.lm_head)
    head = output_head(model)[0] if cfg.lm_head else None
    if head is not None and head not in stats.linear_input:
        raise ValueError(f"calibration statistics lack the output head {head!r} (made by an older version): "
                         "re-run `devin-compile quantize calibrate`, or use lm_head=False")
    missing = sorted(set(lins) - set(stats.linear_input))
    if missing:
        raise ValueError(f"calibration statistics lack {len(missing)} linears of this model, e.g. {missing[:3]}")
    weights = {n: m.weight.detach().float().cpu() for n, m in lins.items()}
    groups: dict[str, list[str]] = {}
    for n in lins:
        groups.setdefault(stats.linear_input[n], []).append(n)
    notes: list[str] = []
    in_scale: dict[str, torch.Tensor] = {}
    row_scale: dict[str, torch.Tensor] = {}
    overrides: dict[str, torch.Tensor] = {}
    gsize = {n: fmt.choose_group_size(w.shape[1], cfg.group_size) for n, w in weights.items()}

    if cfg.method == "awq":
        params = dict(model.named_parameters())
        unfolded = []
        for key, names in groups.items():
            h, a = stats.hessian[key].float(), stats.absmean[key]
            norm = stats.producer.get(key)
            src = None if norm is not None else _fold_source(names[0], lins) if len(names) == 1 else None
            if norm is None and src is None:
                unfolded.append(names[0])
                continue
            s, _alpha, _e, _e0 = awq.search_scale([weights[n] for n in names], h, a, gsize[names[0]][0])
            for n in names:
                in_scale[n] = s
            if norm is not None:
                pname = f"{norm}.weight"
                overrides[pname] = (params[pname].detach().float().cpu() / s).to(params[pname].dtype)
            else:
                row_scale[src] = 1.0 / s
        if unfolded:
            notes.append(f"AWQ: no preceding norm or linear to fold scales into for {len(unfolded)} linears "
                         f"(e.g. {unfolded[0]}): clipping search only")

    linears: dict[str, QLinear] = {}
    for i, (n, w) in enumerate(weights.items()):
        key = stats.linear_input[n]
        h = stats.hessian[key].float()
        g, why = gsize[n]
        s_in, s_row = in_scale.get(n), row_scale.get(n)
        ws = w
        if s_in is not None:
            ws = ws * s_in[None, :]
            h = h / (s_in[:, None] * s_in[None, :])  # the input is x / s now
        if s_row is not None:
            ws = ws * s_row[:, None]
        if cfg.method == "gptq":
            grid = awq.clip_search(ws, h, g) if cfg.clip else None
            q, sc, mn, _info = gptq.gptq_quantize(ws, h, g, damp=cfg.damp, act_order=cfg.act_order, grid=grid)
        elif cfg.method == "awq" and cfg.clip and not _is_qk(n):
            sc, mn = awq.clip_search(ws, h, g)
            q = fmt.quantize_with(ws, sc, mn, g)
        else:
            q, sc, mn = fmt.rtn_quantize(ws, g)
        dw = fmt.dequantize(q, sc, mn, g) - ws
        row_err = awq.output_error(dw, h)
        err = float(row_err.sum())
        signal = float(awq.output_error(ws, h).sum())
        loss_delta = None
        fisher = stats.fisher.get(n)
        if fisher is not None:
            # the output rows were scaled by s_row, so their loss gradients by 1 / s_row
            f = fisher.float() if s_row is None else fisher.float() / s_row.pow(2)
            loss_delta = 0.5 * float((f * row_err).sum())
        linears[n] = QLinear(q, sc, mn, g, why, err, signal, s_in, s_row, loss_delta)
        if progress is not None:
            progress(i + 1, len(weights), n)
    changed = sorted({why for _g, why in gsize.values() if why})
    notes.extend(f"group size: {why}" for why in changed)
    return QuantResult(cfg.method, cfg.bits, cfg.group_size, linears, overrides, model_fingerprint(model),
                       config=_config_dict(cfg), seconds=time.perf_counter() - t0,
                       calib={"tokens": stats.tokens, "num_chunks": stats.num_chunks, "chunk_len": stats.chunk_len,
                              "data": stats.data, "seconds": stats.seconds}, notes=notes,
                       groups=[list(g) for g in groups.values()], head=head)


def _config_dict(cfg: QuantConfig) -> dict:
    return dataclasses.asdict(cfg)


def simulate(model: torch.nn.Module, result: QuantResult, int4: set[str] | None = None) -> torch.nn.Module:
    """A deep copy of ``model`` with the linears in ``int4`` (default: all) replaced by their
    dequantized weights and the others by their full-precision weights, AWQ folds applied:
    what the compiled model computes, in eager PyTorch (for tests and evaluation)."""
    import copy

    sim = copy.deepcopy(model)
    if result.head is not None:
        untie_head(sim)
    params = dict(sim.named_parameters())
    lins = quantizable_linears(sim, lm_head=result.head is not None)
    chosen = set(result.linears) if int4 is None else set(int4)
    with torch.no_grad():
        for pname, value in result.overrides.items():
            params[pname].copy_(value)
        for n, ql in result.linears.items():
            w = lins[n].weight
            w.copy_(ql.dequantized(w.dtype) if n in chosen else ql.fp_weight(w))
    return sim


def untie_head(model: torch.nn.Module) -> None:
    """Give a head tied to the input embedding its own weight (a copy), so writing one leaves the other."""
    head = output_head(model)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and emb is not None and head[1].weight is emb.weight:
        head[1].weight = torch.nn.Parameter(head[1].weight.detach().clone(), requires_grad=False)


def sensitivity(result: QuantResult, groups: list[list[str]]) -> tuple[list[float], str]:
    """Per group of linears (computed by one graph linear): the estimated loss increase when
    that group alone is quantized, if every linear of ``result`` has one (calibration with
    output-gradient statistics), else the relative output error. Returns (values, kind)."""
    lins = result.linears
    if all(ql.loss_delta is not None for ql in lins.values()):
        return [sum(lins[n].loss_delta for n in g) for g in groups], "loss"
    return [sum(lins[n].err for n in g) / max(1e-30, sum(lins[n].signal for n in g)) for g in groups], "relative"


def resolve_max_kl(model: torch.nn.Module, result: QuantResult, chunks, max_kl: float) -> dict:
    """Turn a ``max_kl`` target into ``keep_fp=N``: the fewest most-sensitive linear groups kept in
    the model dtype for which the eager simulation's mean KL against ``model`` on ``chunks``
    (calibration text) is at most ``max_kl`` (binary search over N; KL falls as N grows)."""
    from .evaluate import compare, hf_logits_fn, reference_logits

    groups = result.groups or [[n] for n in result.linears]
    sens, _kind = sensitivity(result, groups)
    order = sorted(range(len(groups)), key=lambda i: -sens[i])
    ref = reference_logits(hf_logits_fn(model), chunks)

    def kl_keeping(n: int) -> float:
        keep = {name for i in order[:n] for name in groups[i]}
        sim = simulate(model, result, int4=set(result.linears) - keep)
        return compare(hf_logits_fn(sim), chunks, ref).kl

    lo, hi = 0, len(groups)
    measured = {}
    while lo < hi:
        mid = (lo + hi) // 2
        measured[mid] = kl_keeping(mid)
        if measured[mid] <= max_kl:
            hi = mid
        else:
            lo = mid + 1
    kl = measured.get(lo, 0.0 if lo == len(groups) else kl_keeping(lo))
    result.notes.append(f"target max_kl={max_kl}: keep_fp={lo} of {len(groups)} linear groups "
                        f"(KL {kl:.4f} on {len(chunks)} calibration chunks)")
    return {"kind": "keep_fp", "value": lo}
