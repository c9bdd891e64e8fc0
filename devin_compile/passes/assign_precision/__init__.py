"""assign_precision: decoder linears → ``devin::int4_linear``, ``devin::fp8_linear`` or the model dtype.

Pattern → replacement::

    linear(x, W[, b])  →  devin::int4_linear(x, qweight, scales_zeros, g, N, kernel, b, dense, max_int4_tokens)
                          (for the linears chosen for INT4)
    linear(x, W[, b])  →  devin::fp8_linear(x, qweight, scale, N, kernel, b, dense, max_fp8_tokens)
                          (for the linears chosen for FP8, with ``tiers`` including "fp8"; the others keep ``linear``)

Input: a :class:`~devin_compile.quant.quantize.QuantResult` (every decoder linear quantized
by RTN/AWQ/GPTQ, from ``optimize(quantization=...)`` or a saved artifact) and the target.

1. Each graph linear is mapped to the HF linears it computes (one, or several after
   ``fuse_projections``, which records them in ``node.meta["fused_weights"]``). Linears the
   result does not cover (lm_head, tied to the embedding in SmolLM2, unless it was quantized
   with ``lm_head="int4"``) stay as they are; a fused linear covered only in part is a
   ``PassError``. A quantized head gets its own INT4 weight and no dense copy: it only sees the
   rows that need logits. An embedding tied to an INT4 head (without AWQ scales) reads the head's
   rows (``embedding(W, ids)`` → ``devin::int4_embedding(ids, qweight, scales_zeros, ..., col_scale)``,
   ``col_scale`` = 1 / AWQ's input scale of the head), so the dense table is released; an FP8 head
   leaves the embedding on the dense table. An INT8 head (``lm_head="int8"``, the default; outside the
   target) becomes ``devin::int8_linear`` and a tied embedding ``devin::int8_embedding`` of its operands
   (:mod:`.quantized_head`).
2. Sensitivity of a graph linear (:func:`~devin_compile.quant.quantize.sensitivity`): the
   estimated increase of the next-token loss when it alone is quantized,
   ``Σ ½ Σ_j fisher_j (ΔW H_g ΔWᵀ)_jj`` over its parts (``fisher``: the calibration's squared
   output gradients; ``H_g``: its gradient-weighted input Hessian), so layers whose errors the rest of the network amplifies rank higher;
   without output-gradient statistics (``fisher=False``, older calibrations), the relative
   output error ``Σ tr(ΔW H ΔWᵀ) / Σ tr(W H Wᵀ)``. The note says which.
3. The target picks each linear's precision (:mod:`devin_compile.quant.precision`): ``all``;
   ``keep_fp=N`` (all but the N most sensitive); ``int4_fraction=f`` (at least a fraction f of
   the decoder-linear weights in INT4: the linears with the highest sensitivity per weight stay
   in the model dtype while the fraction allows); ``memory_bytes=B`` / ``memory_fraction=f``
   (decoder-linear weight bytes at most B, or f times their bytes in the model dtype: among
   ``tiers`` (INT4, FP8) and the model dtype, the mix of least total estimated loss that fits,
   a multiple-choice knapsack solved by dynamic programming over the bytes); ``keep=[names]``
   (these HF linears, and the graph linears fused with them, stay unquantized); ``max_kl=x`` is
   resolved before compiling into ``keep_fp=N`` by measuring the KL of eager simulations on
   calibration text (:func:`~devin_compile.quant.quantize.resolve_max_kl`).
4. INT4 linears become ``devin::int4_linear`` and FP8 linears ``devin::fp8_linear``
   (operands prepared once for the kernel; FP8's sensitivity is the same statistic for its rounding).
   Steps of more than ``max_int4_tokens`` (``max_fp8_tokens``) tokens run a dense GEMM over tiles of
   the weight dequantized per step (:mod:`~devin_compile.ops.dequant_tiles`; no dense copy kept), or,
   with ``dense_prefill=True`` (and by default for aten's "cpu" INT4 kernel, which has no tiles), over a
   dequantized dense copy (:func:`~devin_compile.ops.dense_copy.dense_copy_policy`: oneDNN-prepacked on
   CPU; on CPUs without native bf16/fp16 GEMMs run by :func:`~devin_compile.ops.upcast_linear.upcast_linear`).
   Kept linears of an AWQ result get their folded full-precision weight; AWQ's scaled norm weights
   replace the originals.
5. Under tensor parallelism, steps 1-3 see the whole linears (so every rank chooses the precision one
   process chooses) and step 4 this rank's slices of them, cut as ``shard_tensor_parallel`` cut the
   weights (:mod:`.shards`); the report's bytes are this rank's.

The report's note gives the counts, bytes and kernel; ``details`` is the per-layer table
(precision, bits, group size, sensitivity, bytes), also handed back in ``ctx.outputs.precision_table``
(and the note in ``ctx.outputs.precision_note``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ...graph_utils import (add_call, add_constant, counted_nodes, eliminate_dead_code, fake_like, hf_name, is_call,
                           linear_bias, node_delta, param_of)
from ...ops import dequant_tiles
from ...ops import fp8_linear as fp8_op
from ...ops import int4_linear as int4_op
from ...ops.dense_copy import DenseCopyPolicy, dense_copy_policy
from ...pipeline import Pass, PassContext, PassError, PassResult
from ...quant.config import QuantConfig
from ...quant.precision import Candidate, choose_tiers
from ...quant.result import QuantResult, has_fp8, sensitivity
from .quantized_head import embed_from_int4_head, int8_head_to_op
from .shards import local_candidate, shard_qlinear, slices_of

aten = torch.ops.aten
SENSITIVITY_KINDS = {"loss": "estimated loss increase (output-gradient weighted)",
                     "relative": "relative output error (calibration has no output gradients)"}


@dataclass(frozen=True)
class _Kernels:
    """The kernels this device and activation dtype get, and what serves the steps above their limits."""

    int4: str
    int4_max_tokens: int  # -1: the INT4 kernel serves every step
    int4_long: str  # steps above the limit: "dense" (a dense copy), "tiles" (dequantized tiles), "" (none)
    fp8: str
    fp8_max_tokens: int  # -1: the FP8 kernel serves every step
    fp8_long: str
    dense_copy: DenseCopyPolicy


def long_steps(kernel: str, tiles: bool, dense_prefill: bool | None) -> str:
    """What runs a CPU quantized kernel's long steps: "dense" copies where ``dense_prefill`` asks (by default
    only where there are no tiles), "tiles" where the C kernels are, else "" (the kernel runs every step)."""
    if kernel not in ("cpu", "cpu_c"):
        return ""
    dense = dense_prefill if dense_prefill is not None else not tiles
    return "dense" if dense else "tiles" if tiles else ""


class AssignPrecision(Pass):
    name = "assign_precision"

    def __init__(self, result: QuantResult, qconfig: QuantConfig) -> None:
        super().__init__(qconfig)
        self.result = result
        self.qconfig = qconfig

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        before = counted_nodes(gm)
        dtype, device = ctx.info.dtype, ctx.info.device
        cands, local = self._candidates(gm, dtype)
        choice, sens_kind = self._choose_tiers(cands)  # on the whole linears: every rank chooses as one process
        cands = [local_candidate(c, parts, dtype) for c, parts in zip(cands, local)]
        cut = sum(any(slices_of(c.node)) for c in cands)
        kernels = self._kernels(device, dtype)
        rows, dense_bytes, self.tied_rows = [], 0, 0
        for i, (c, tier, parts) in enumerate(zip(cands, choice, local)):
            name = c.node.name
            if tier == "int4":
                dense_bytes += self._to_int4(gm, i, c, parts, kernels, dtype, device)
            elif tier == "fp8":
                dense_bytes += self._to_fp8(gm, i, c, parts, kernels, dtype, device)
            elif any(p.in_scale is not None or p.row_scale is not None for p in parts):
                self._fold_awq(gm, i, c, parts)
            rows.append(_row(c, name, tier, parts, sens_kind, dtype))
        head_row, tied = int8_head_to_op(gm, self.result.int8_head, device, dtype)
        self.tied_rows += tied
        self._apply_overrides(gm)
        eliminate_dead_code(gm)
        note = f"{self._note(cands, choice, rows, kernels, sens_kind, dense_bytes)}; {node_delta(gm, before)}"
        if cut:
            note += f"; tensor parallel: {cut} of {len(cands)} linears hold this rank's slice"
        if head_row is not None:
            rows.append(head_row)
            note += (f"; lm_head int8 ({head_row['bytes'] / 2**20:.1f} MiB vs {head_row['fp_bytes'] / 2**20:.1f} "
                     f"MiB, {head_row['kernel']} kernel)")
        if self.tied_rows:
            note += f"; {self.tied_rows} tied embedding reads the {'INT8' if head_row else 'INT4'} head"
        ctx.outputs.precision_table, ctx.outputs.precision_note = rows, note
        return PassResult(matches=choice.count("int4") + choice.count("fp8") + (head_row is not None), note=note,
                          details=precision_table_markdown(rows))

    def _candidates(self, gm: torch.fx.GraphModule, dtype: torch.dtype) -> tuple[list[Candidate], list[list]]:
        """One candidate per graph linear that computes quantized-model linears (sensitivities unset; shapes
        and bytes of the whole linears), and its parts as this rank holds them (:mod:`.shards`)."""
        res = self.result
        elem = torch.empty((), dtype=dtype).element_size()
        cands: list[Candidate] = []
        local: list[list] = []
        for node in gm.graph.nodes:
            w = param_of(gm, node.args[1]) if is_call(node, aten.linear.default) else None
            if w is None:
                continue
            names = [hf_name(t) for t in node.meta.get("fused_weights") or [node.args[1].target]]
            known = [n in res.linears for n in names]
            if not any(known):
                continue
            if not all(known):
                raise PassError(f"assign_precision: graph linear {node.name} computes {names}, but the quantized "
                                f"model covers only {[n for n, k in zip(names, known) if k]}")
            parts = [res.linears[n] for n in names]
            n_out, k, g = sum(p.shape[0] for p in parts), parts[0].shape[1], parts[0].group_size
            mine = [shard_qlinear(p, cut, n) for p, cut, n in zip(parts, slices_of(node), names)]
            shape = (sum(p.shape[0] for p in mine), mine[0].shape[1])
            if tuple(w.shape) != shape or any(p.shape[1] != shape[1] or p.group_size != g for p in mine):
                raise PassError(f"assign_precision: graph linear {node.name} has weight {tuple(w.shape)}, the "
                                f"quantized parts {names} have shapes {[p.shape for p in mine]}")
            fp_bytes, int4_bytes = n_out * k * elem, int4_op.int4_bytes(n_out, k, g, elem)
            cands.append(Candidate(node, names, n_out, k, g, 0.0, fp_bytes, int4_bytes))
            local.append(mine)
        if not cands:
            raise PassError("assign_precision: no graph linear matches the quantized model's linears "
                            f"(e.g. {next(iter(res.linears), None)}); was it made for this model?")
        uncovered = sorted(set(res.linears) - {n for c in cands for n in c.names})
        if uncovered:
            raise PassError(f"assign_precision: {len(uncovered)} quantized linears have no linear in the graph, "
                            f"e.g. {uncovered[:3]}")
        return cands, local

    def _choose_tiers(self, cands: list[Candidate]) -> tuple[list[str], str]:
        """Each candidate's sensitivities, then the target's tier per candidate; (tiers, sensitivity kind)."""
        res, tiers = self.result, self.qconfig.tiers
        if "fp8" in tiers and not has_fp8(res):
            raise PassError("assign_precision: tiers include 'fp8', but the quantized model has no FP8 weights "
                            "(quantize it with tiers including 'fp8', e.g. `quantize run --tiers int4,fp8`)")
        names = [c.names for c in cands]
        values, sens_kind = sensitivity(res, names)
        fp8_values = sensitivity(res, names, "fp8")[0] if "fp8" in tiers else [None] * len(cands)
        for c, v, v8 in zip(cands, values, fp8_values):
            c.sensitivity, c.fp8_sensitivity, c.fp8_bytes = v, v8, fp8_op.fp8_bytes(c.n, c.k)
        return choose_tiers(cands, self.qconfig.target, tiers), sens_kind

    def _kernels(self, device: torch.device, dtype: torch.dtype) -> _Kernels:
        """The INT4 kernel (and its limit), the FP8 kernel (and its), what serves long steps, the dense-copy policy."""
        cfg = self.qconfig
        kernel = int4_op.default_kernel(device) if cfg.kernel == "auto" else cfg.kernel
        int4_op.check_kernel(kernel, device)
        tiles = device.type == "cpu" and dequant_tiles.available()
        int4_long = long_steps(kernel, tiles and kernel == "cpu_c", cfg.dense_prefill)
        if not int4_long:
            limit = -1
        elif cfg.max_int4_tokens is not None:
            limit = cfg.max_int4_tokens
        else:
            limit = int4_op.max_int4_tokens(kernel, dtype)
        fp8_kernel = fp8_op.default_kernel(device)
        fp8_long = long_steps(fp8_kernel, tiles, cfg.dense_prefill)
        return _Kernels(kernel, limit, int4_long, fp8_kernel, fp8_op.max_fp8_tokens(dtype) if fp8_long else -1,
                        fp8_long, dense_copy_policy(device, dtype))

    def _to_int4(self, gm, i: int, c: Candidate, parts, kernels: _Kernels, dtype, device) -> int:
        """``linear`` → ``devin::int4_linear``; returns the bytes of its dense copy (0 without one)."""
        node, w_node = c.node, c.node.args[1]
        q, scale, minv = (torch.cat([getattr(p, a) for p in parts]) for a in ("q", "scale", "minv"))
        qw, sz = int4_op.prepare_operands(kernels.int4, q, scale, minv, c.group_size, dtype, device)
        head = c.names == [self.result.head]  # the head only sees the rows that need logits: no dense copy
        with gm.graph.inserting_before(node):
            qw_node = add_constant(gm, f"int4_{i}_qweight", qw, fake_like(w_node, qw))
            sz_node = add_constant(gm, f"int4_{i}_scales_zeros", sz, fake_like(w_node, sz))
            kwargs = {"bias": linear_bias(node), "max_int4_tokens": -1 if head else kernels.int4_max_tokens}
            dense = kernels.int4_long == "dense" and not head
            if dense:
                _add_dense_copy(gm, f"int4_{i}_dense", int4_op.dequantize(q, scale, minv, c.group_size, dtype),
                                w_node, kwargs, kernels.dense_copy)
            new = add_call(gm.graph, torch.ops.devin.int4_linear.default,
                           (node.args[0], qw_node, sz_node, c.group_size, c.n, kernels.int4), kwargs, like=node)
        if head and parts[0].embedding_readable:
            self.tied_rows += embed_from_int4_head(gm, i, param_of(gm, w_node), (qw_node, sz_node), parts[0], c,
                                                   kernels.int4, dtype)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        return c.fp_bytes if dense else 0

    def _to_fp8(self, gm, i: int, c: Candidate, parts, kernels: _Kernels, dtype, device) -> int:
        """``linear`` → ``devin::fp8_linear``; returns the bytes of its dense copy (0 without one)."""
        node, w_node = c.node, c.node.args[1]
        q8, s8 = torch.cat([p.fp8_q for p in parts]), torch.cat([p.fp8_scale for p in parts])
        qw, sc = fp8_op.prepare_operands(kernels.fp8, q8, s8, device)
        limit = -1 if c.names == [self.result.head] else kernels.fp8_max_tokens
        with gm.graph.inserting_before(node):
            qw_node = add_constant(gm, f"fp8_{i}_qweight", qw, fake_like(w_node, qw))
            sc_node = add_constant(gm, f"fp8_{i}_scale", sc, fake_like(w_node, sc))
            kwargs = {"bias": linear_bias(node), "max_fp8_tokens": limit}
            if limit >= 0 and kernels.fp8_long == "dense":
                _add_dense_copy(gm, f"fp8_{i}_dense", fp8_op.dequantize(q8, s8, dtype), w_node, kwargs,
                                kernels.dense_copy)
            new = add_call(gm.graph, torch.ops.devin.fp8_linear.default,
                           (node.args[0], qw_node, sc_node, c.n, kernels.fp8), kwargs, like=node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        return c.fp_bytes if limit >= 0 and kernels.fp8_long == "dense" else 0

    def _fold_awq(self, gm, i: int, c: Candidate, parts) -> None:
        """A linear kept in the model dtype reads AWQ's folded full-precision weight."""
        w_node = c.node.args[1]
        w = param_of(gm, w_node)
        pieces, start = [], 0
        for p in parts:
            pieces.append(p.fp_weight(w[start:start + p.shape[0]].detach()))
            start += p.shape[0]
        folded = torch.cat(pieces)
        with gm.graph.inserting_before(c.node):
            new_w = add_constant(gm, f"awq_{i}_weight", folded, fake_like(w_node, folded))
        c.node.replace_input_with(w_node, new_w)

    def _note(self, cands: list[Candidate], choice: list[str], rows: list[dict], kernels: _Kernels, sens_kind: str,
              dense_bytes: int) -> str:
        """The report's note: counts, shares, bytes, group sizes, sensitivity kind, kernels."""
        res, tiers, target = self.result, self.qconfig.tiers, self.qconfig.target
        n4, n8 = choice.count("int4"), choice.count("fp8")
        ptot = sum(c.params for c in cands)
        p4 = sum(c.params for c, t in zip(cands, choice) if t == "int4")
        p8 = sum(c.params for c, t in zip(cands, choice) if t == "fp8")
        total_bytes = sum(r["bytes"] for r in rows)
        fp_bytes = sum(c.fp_bytes for c in cands)
        groups = sorted({(c.group_size, r["group_note"]) for c, r in zip(cands, rows) if r["precision"] == "int4"})
        gnote = "; ".join(f"g{g}" + (f" ({why})" if why else "") for g, why in groups)
        what = "decoder-linear + lm_head" if res.head else "decoder-linear"
        tiers_note = f"FP8 {n8}/{len(cands)} linears ({p8 / ptot:.1%}), " if "fp8" in tiers else ""
        return (f"{res.method} INT4 {n4}/{len(cands)} linears ({p4 / ptot:.1%} of {what} weights), {tiers_note}"
                f"target {target['kind']}" + (f"={target['value']}" if target["value"] is not None else "")
                + f"; {what} weights {total_bytes / 2**20:.1f} MiB vs {fp_bytes / 2**20:.1f} MiB"
                + (f" (+ {dense_bytes / 2**20:.1f} MiB dense copies for long steps: dense_prefill=False drops them)"
                   if dense_bytes else "")
                + (f"; {gnote}" if gnote else "") + f"; sensitivity: {SENSITIVITY_KINDS[sens_kind]}; "
                + _kernel_note(kernels, n8))

    def _apply_overrides(self, gm: torch.fx.GraphModule) -> None:
        for j, (pname, value) in enumerate(sorted(self.result.overrides.items())):
            nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "m." + pname]
            if not nodes:
                raise PassError(f"assign_precision: the graph never reads {pname}, which AWQ rescaled")
            old = param_of(gm, nodes[0])
            attr = f"awq_override_{j}"
            gm.register_buffer(attr, value.to(device=old.device, dtype=old.dtype), persistent=False)
            for n in nodes:
                n.target = attr


def _add_dense_copy(gm: torch.fx.GraphModule, name: str, weight: torch.Tensor, w_node: torch.fx.Node, kwargs: dict,
                    policy: DenseCopyPolicy) -> None:
    """A dequantized dense copy for steps above the kernel's limit, made as ``policy`` says; sets the op's
    ``dense`` (and ``dense_kernel`` when not a plain linear) keyword arguments."""
    dense = policy.make(weight)
    if policy.kernel != "linear":
        kwargs["dense_kernel"] = policy.kernel
    kwargs["dense"] = add_constant(gm, name, dense, fake_like(w_node, dense))


def _kernel_note(k: _Kernels, n8: int) -> str:
    """Which kernel serves which steps (the last part of the note)."""
    above = {"dense": "dense {}copy above", "tiles": "dequantized tiles + dense GEMM above (no dense copy)"}
    if k.int4_long and k.int4_max_tokens > 0:
        mode = f"{k.int4} kernel for steps of <= {k.int4_max_tokens} tokens, " + above[k.int4_long].format(
            k.dense_copy.describe)
    elif k.int4_long == "dense":
        mode = "dense dequantized copy for every step (fp32: the CPU int4 kernel has no fast fp32 path)"
    elif k.int4_long == "tiles":
        mode = "dequantized tiles + dense GEMM for every step"
    else:
        mode = f"{k.int4} kernel for every step"
    if n8:
        mode += f"; FP8 {k.fp8} kernel" + (f" for steps of <= {k.fp8_max_tokens} tokens, "
                                            + above[k.fp8_long].format(k.dense_copy.describe)
                                            if k.fp8_long else " for every step")
    return mode


def _row(c: Candidate, name: str, tier: str, parts, sens_kind: str, dtype: torch.dtype) -> dict:
    """One row of the precision table (``ctx.outputs.precision_table``)."""
    why = next((p.group_note for p in parts if p.group_note), "") if tier == "int4" else ""
    elem_bits = torch.empty((), dtype=dtype).element_size() * 8
    return {"linear": _label(c.names), "graph_node": name,
            "precision": tier if tier != "fp" else str(dtype).replace("torch.", ""),
            "bits": {"int4": 4, "fp8": 8}.get(tier, elem_bits),
            "group_size": c.group_size if tier == "int4" else None, "group_note": why,
            "sensitivity": c.sensitivity, "fp8_sensitivity": c.fp8_sensitivity, "sensitivity_kind": sens_kind,
            "bytes": {"int4": c.int4_bytes, "fp8": c.fp8_bytes}.get(tier, c.fp_bytes), "params": c.params}


def _label(names: list[str]) -> str:
    """``a.b.q_proj+k_proj+v_proj`` for fused siblings (full names when prefixes differ)."""
    prefix = names[0].rpartition(".")[0]
    if all(n.rpartition(".")[0] == prefix for n in names):
        return "+".join([names[0]] + [n.rpartition(".")[2] for n in names[1:]])
    return "+".join(names)


def precision_table_markdown(rows: list[dict]) -> str:
    """The per-layer table; with FP8 candidates, each linear's FP8 sensitivity next to its INT4 one."""
    fp8 = any(r.get("fp8_sensitivity") is not None for r in rows)
    lines = ["| linear | precision | group | sensitivity | " + ("FP8 sensitivity | " if fp8 else "") + "bytes |",
             "|---|---|---:|---:|" + ("---:|" if fp8 else "") + "---:|"]
    for r in rows:
        g = "" if r["group_size"] is None else str(r["group_size"]) + (" *" if r["group_note"] else "")
        s8 = (f"{r['fp8_sensitivity']:.2e} | " if r.get("fp8_sensitivity") is not None else " | ") if fp8 else ""
        lines.append(f"| {r['linear']} | {r['precision']} | {g} | {r['sensitivity']:.2e} | {s8}{r['bytes']} |")
    notes = sorted({r["group_note"] for r in rows if r["group_note"]})
    lines.extend(f"\n\\* {n}" for n in notes)
    return "\n".join(lines)
