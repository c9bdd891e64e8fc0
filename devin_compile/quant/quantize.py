"""Quantize a Hugging Face model's decoder linears from calibration statistics.

:func:`quantize_model` runs RTN, AWQ or GPTQ on every decoder linear (all of them are
candidates: which ones end up INT4 is decided by the ``assign_precision`` pass from the
target) and returns a :class:`~.result.QuantResult`: per linear the logical INT4 weight
(:mod:`devin_compile.backends.int4.format`), its output error ``tr(ΔW H ΔWᵀ)`` and signal
``tr(W H Wᵀ)`` on the calibration tokens (their ratio: the relative output error when that
layer alone is quantized), its estimated loss increase ``½ Σ_j fisher_j (ΔW H_g ΔWᵀ)_jj`` when
the calibration has output-gradient statistics (:mod:`.calibration`; ``H_g`` the
gradient-weighted Hessian, ``H`` in calibrations made before it), and for AWQ the scales
folded into norms and preceding linears. With ``tiers`` including ``fp8``, each linear also gets
its FP8 weight (e4m3, per-row absmax scales: :mod:`devin_compile.backends.fp8.format`, RTN
whatever the method) with the same error and loss statistics.

What GPTQ and AWQ's searches minimise is :func:`objective_hessian` (the activation Hessian
blended with the gradient-weighted one, ``loss_weight``); their grids come from
:func:`.awq.clip_search` (each end of a group's range moved on its own), optionally anchored on
each linear's strongest input channels (:mod:`.anchor`, ``anchors``); then each group's grid is
refitted to its codes by least squares, ``refits`` rounds (:mod:`.grid_refit`). Each linear is rounded with
``config.for_linear(name)``: the top-level options with its ``per_linear`` overrides applied.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping

import torch

from . import awq, gptq
from .anchor import anchor_outlier_channels
from ..backends.fp8 import format as fp8_fmt
from ..backends.int4 import format as fmt
from ..backends.int8 import format as int8_fmt
from .calibration_stats import CalibrationStats
from .model_linears import model_fingerprint, output_head, quantizable_linears
from .config import QuantConfig
from .grid_refit import refit_and_reround
from .progress import Progress, ProgressArg
from .result import Int8Head, QLinear, QuantResult
from .threads import map_ordered


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


def quantize_model(model: torch.nn.Module, stats: CalibrationStats, config: QuantConfig | Mapping | None = None,
                   progress: ProgressArg = None) -> QuantResult:
    """Quantize every decoder linear of ``model`` (not modified) with ``config.method``, and the
    output head: to INT8 per row with ``lm_head="int8"`` (the default), like the decoder linears with
    ``lm_head="int4"`` (its AWQ scale folds into the final norm).

    ``progress`` (:mod:`.progress`; default ``config.progress``): AWQ's scale search per input
    group, then the per-linear loop; a callable gets ``(done, total, linear or input name)``."""
    cfg = QuantConfig.coerce(config) if config is not None else QuantConfig()
    if progress is None:
        progress = cfg.progress
    t0 = time.perf_counter()
    lins = quantizable_linears(model, cfg.lm_head == "int4")
    head = output_head(model)[0] if cfg.lm_head == "int4" else None
    _check_statistics_cover(stats, lins, head)
    weights = {n: m.weight.detach().float().cpu() for n, m in lins.items()}
    groups: dict[str, list[str]] = {}
    for n in lins:
        groups.setdefault(stats.linear_input[n], []).append(n)
    gsize = {n: fmt.choose_group_size(w.shape[1], cfg.group_size) for n, w in weights.items()}
    notes: list[str] = []
    folds = _AwqFolds()
    if cfg.method == "awq":
        folds = _awq_scales(model, stats, cfg, lins, weights, groups, gsize, progress)
        if folds.unfolded:
            notes.append(f"AWQ: no preceding norm or linear to fold scales into for {len(folds.unfolded)} linears "
                         f"(e.g. {folds.unfolded[0]}): clipping search only")
    if cfg.method != "rtn" and cfg.loss_weight > 0 and not stats.grad_hessian:
        notes.append("objective: the activation Hessian alone (the calibration has no output-gradient statistics; "
                     "re-run calibration with them to use loss_weight)")
    bar = Progress(progress, len(weights), f"{cfg.method.upper()} INT4 g{cfg.group_size}")
    done = map_ordered(lambda n: _quantize_linear(n, weights[n], stats, cfg, gsize[n], folds.in_scale.get(n),
                                                  folds.row_scale.get(n)), weights,
                       lambda i, n, _ql: bar.update(i + 1, n))  # one linear per worker thread (.threads)
    linears: dict[str, QLinear] = dict(zip(weights, done))
    changed = sorted({why for _g, why in gsize.values() if why})
    notes.extend(f"group size: {why}" for why in changed)
    return QuantResult(cfg.method, cfg.bits, cfg.group_size, linears, folds.overrides, model_fingerprint(model),
                       config=_config_dict(cfg), seconds=time.perf_counter() - t0,
                       calib={"tokens": stats.tokens, "num_chunks": stats.num_chunks, "chunk_len": stats.chunk_len,
                              "data": stats.data, "seconds": stats.seconds}, notes=notes,
                       groups=[list(g) for g in groups.values()], head=head,
                       int8_head=_int8_head(model, stats) if cfg.lm_head == "int8" else None)


def _int8_head(model: torch.nn.Module, stats: CalibrationStats) -> Int8Head | None:
    """The output head rounded to INT8 per row (None when the model's head is not a linear), with its error
    statistics when the calibration covers the head's input."""
    found = output_head(model)
    if found is None:
        return None
    name, lin = found
    w = lin.weight.detach().float().cpu()
    q, scale = int8_fmt.quantize(w)
    head = Int8Head(name, q, scale, tuple(w.shape))
    key = stats.linear_input.get(name)
    if key is not None:
        h = stats.hessian[key].float()
        dw = int8_fmt.dequantize(q, scale) - w
        head.err, head.signal = float(awq.output_error(dw, h).sum()), float(awq.output_error(w, h).sum())
        head.loss_delta = _loss_delta(dw, stats.grad_hessian.get(key, h).float(), stats.fisher.get(name))
    return head


def _check_statistics_cover(stats: CalibrationStats, lins: dict[str, torch.nn.Linear], head: str | None) -> None:
    """Raise unless ``stats`` has the input statistics of every linear to quantize."""
    if head is not None and head not in stats.linear_input:
        raise ValueError(f"calibration statistics lack the output head {head!r} (made by an older version): "
                         "re-run `devin-compile quantize calibrate`, or use lm_head=False")
    missing = sorted(set(lins) - set(stats.linear_input))
    if missing:
        raise ValueError(f"calibration statistics lack {len(missing)} linears of this model, e.g. {missing[:3]}")


@dataclasses.dataclass
class _AwqFolds:
    """AWQ's scales: per linear its input scale and (folded into a preceding linear) row scale,
    the norm weights divided by their scales, and the linears with nowhere to fold one."""
    in_scale: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    row_scale: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    overrides: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    unfolded: list[str] = dataclasses.field(default_factory=list)


def _awq_scales(model: torch.nn.Module, stats: CalibrationStats, cfg: QuantConfig, lins: dict[str, torch.nn.Linear],
                weights: dict[str, torch.Tensor], groups: dict[str, list[str]], gsize: dict[str, tuple],
                progress: ProgressArg) -> _AwqFolds:
    """AWQ's scale search, one per input group, each scale folded into the norm that produces the
    input or else into the one linear whose output rows are that input (:func:`_fold_source`)."""
    folds = _AwqFolds()
    params = dict(model.named_parameters())
    search = Progress(progress, len(groups), "AWQ scale search")

    def scale_of(item: tuple[str, list[str]]) -> torch.Tensor | None:
        key, names = item
        if _fold_target(key, names, stats, lins) == (None, None):
            return None
        lw = cfg.for_linear(names[0]).loss_weight  # a shared input: its first linear's options
        # rows weighted by their output-gradient squares (the loss estimate) when calibration has them
        fis = [stats.fisher.get(n) for n in names] if lw > 0 else []
        rw = [f.float() for f in fis] if fis and all(f is not None for f in fis) else None
        return awq.search_scale([weights[n] for n in names], objective_hessian(stats, key, lw), stats.absmean[key],
                                gsize[names[0]][0], rw)[0]

    scales = dict(zip(groups, map_ordered(scale_of, list(groups.items()),
                                          lambda i, item, _s: search.update(i + 1, item[0]))))
    for key, names in groups.items():
        norm, src = _fold_target(key, names, stats, lins)
        if norm is None and src is None:
            folds.unfolded.append(names[0])
            continue
        s = scales[key]
        for n in names:
            folds.in_scale[n] = s
        if norm is not None:
            pname = f"{norm}.weight"
            folds.overrides[pname] = (params[pname].detach().float().cpu() / s).to(params[pname].dtype)
        else:
            folds.row_scale[src] = 1.0 / s
    return folds


def _fold_target(key: str, names: list[str], stats: CalibrationStats,
                 lins: dict[str, torch.nn.Linear]) -> tuple[str | None, str | None]:
    """(the norm producing input ``key``, or else the one linear whose output rows it is), or (None, None)."""
    norm = stats.producer.get(key)
    src = None if norm is not None else _fold_source(names[0], lins) if len(names) == 1 else None
    return norm, src


def _quantize_linear(name: str, w: torch.Tensor, stats: CalibrationStats, cfg: QuantConfig, group: tuple,
                     s_in: torch.Tensor | None, s_row: torch.Tensor | None) -> QLinear:
    """One linear's INT4 weight (and FP8 with that tier) with its error and loss statistics; ``w``
    is its fp32 weight, ``group`` its (group size, why it differs), ``s_in``/``s_row`` AWQ's folds."""
    lc = cfg.for_linear(name)  # per_linear overrides applied
    key = stats.linear_input[name]
    h = stats.hessian[key].float()
    h_loss = stats.grad_hessian.get(key, h).float()  # the loss estimate's Hessian
    h_obj = objective_hessian(stats, key, lc.loss_weight)  # what GPTQ and the searches minimise
    g, why = group
    ws = w
    if s_in is not None:
        ws = ws * s_in[None, :]
        outer = s_in[:, None] * s_in[None, :]  # the input is x / s now
        h, h_loss, h_obj = h / outer, h_loss / outer, h_obj / outer
    if s_row is not None:
        ws = ws * s_row[:, None]
    q, sc, mn = _round_int4(cfg.method, ws, h_obj, g, lc)
    dw = fmt.dequantize(q, sc, mn, g) - ws
    err = float(awq.output_error(dw, h).sum())
    signal = float(awq.output_error(ws, h).sum())
    f = stats.fisher.get(name)
    if f is not None and s_row is not None:
        f = f.float() / s_row.pow(2)  # the output rows were scaled by s_row, their loss gradients by 1 / s_row
    ql = QLinear(q, sc, mn, g, why, err, signal, s_in, s_row, _loss_delta(dw, h_loss, f))
    if "fp8" in cfg.tiers:
        _add_fp8(ql, ws, h, h_loss, f)
    return ql


def _round_int4(method: str, ws: torch.Tensor, h_obj: torch.Tensor, g: int,
                lc: QuantConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT4 codes, scales and minima of ``ws`` by ``method`` with one linear's options ``lc``."""
    if method == "gptq":
        grid = awq.clip_search(ws, h_obj, g) if lc.clip else None
        if lc.anchors and (grid is not None or lc.act_order):
            if grid is None:
                grid = fmt.params_from_range(*fmt.group_minmax(ws, g))
            grid = anchor_outlier_channels(ws, h_obj, *grid, g, lc.anchors)
        q, sc, mn, _info = gptq.gptq_quantize(ws, h_obj, g, damp=lc.damp, act_order=lc.act_order, grid=grid,
                                            refits=lc.refits)
        return q, sc, mn
    if method == "awq" and lc.clip:
        sc, mn = anchor_outlier_channels(ws, h_obj, *awq.clip_search(ws, h_obj, g), g, lc.anchors)
        return refit_and_reround(ws, h_obj, fmt.quantize_with(ws, sc, mn, g), sc, mn, g, lc.refits)
    return fmt.rtn_quantize(ws, g)


def objective_hessian(stats: CalibrationStats, key: str, loss_weight: float) -> torch.Tensor:
    """The quadratic form GPTQ and AWQ's searches minimise for input ``key``:
    ``H / mean diag H + loss_weight · H_g / mean diag H_g``.

    ``H`` (every calibration token alike) is the classic objective; ``H_g`` weights each token by
    its output-gradient norm, i.e. by how much the loss cares about that token's output. Alone,
    ``H`` spends the error budget on tokens the loss ignores; ``H_g`` alone rests on fewer
    effective tokens and does worse than the blend (held-out ppl, SmolLM2 GPTQ g64, mean of three
    held-out domains: H +11.2%, H_g +10.0%, the blend at weight 1 +8.9%, at 2 +8.6%; README).
    The scale of either term does not matter to the minimisers (dampening is relative too), so
    both are normalised to a unit mean diagonal."""
    h = stats.hessian[key].float()
    h_g = stats.grad_hessian.get(key)
    if h_g is None or loss_weight == 0:
        return h
    return h / torch.diag(h).mean().clamp(min=1e-30) + loss_weight * (h_g.float() / torch.diag(h_g).mean().clamp(min=1e-30))


def _loss_delta(dw: torch.Tensor, h_loss: torch.Tensor, fisher: torch.Tensor | None) -> float | None:
    """``½ Σ_j fisher_j (ΔW H_g ΔWᵀ)_jj``, the estimated loss increase of the rounding ``dw``."""
    return None if fisher is None else 0.5 * float((fisher.float() * awq.output_error(dw, h_loss)).sum())


def _add_fp8(ql: QLinear, ws: torch.Tensor, h: torch.Tensor, h_loss: torch.Tensor,
             fisher: torch.Tensor | None) -> None:
    """The FP8 tier of one linear: e4m3 codes with per-row absmax scales of the weight the kernels
    see (``ws``, AWQ folds applied), and the same error statistics as INT4's for that rounding."""
    q8, s8 = fp8_fmt.quantize(ws)
    dw = fp8_fmt.dequantize(q8, s8) - ws
    ql.fp8_q, ql.fp8_scale, ql.fp8_err = q8, s8, float(awq.output_error(dw, h).sum())
    ql.fp8_loss_delta = _loss_delta(dw, h_loss, fisher)


def _config_dict(cfg: QuantConfig) -> dict:
    """The options the weights were made with (saved in the artifact; ``progress`` is not one)."""
    return {k: v for k, v in dataclasses.asdict(dataclasses.replace(cfg, progress=False)).items() if k != "progress"}
