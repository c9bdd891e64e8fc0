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
   with ``lm_head=True``) stay as they are; a fused linear covered only in part is a
   ``PassError``. A quantized head gets its own INT4 weight (a tied embedding keeps reading
   the model-dtype one) and no dense copy: it only sees the rows that need logits.
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
   (operands prepared once for the kernel; FP8's sensitivity is the same statistic for its rounding);
   with ``dense_prefill`` a dequantized dense copy (oneDNN-prepacked on CPU; on CPUs without
   native bf16/fp16 GEMMs run by :func:`~devin_compile.ops.upcast_linear.upcast_linear`) serves
   steps of more than ``max_int4_tokens`` tokens. Kept linears of an AWQ result get their folded
   full-precision weight; AWQ's scaled norm weights replace the originals.

The report's note gives the counts, bytes and kernel; ``details`` is the per-layer table
(precision, bits, group size, sensitivity, bytes), also kept in ``ctx.extras["precision_table"]``.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import add_call, counted_nodes, is_call, node_delta
from ..ops import fp8_linear as fp8_op
from ..ops import int4_linear as int4_op
from ..ops.prepacked_linear import prepack_supported
from ..pipeline import Pass, PassContext, PassError, PassResult
from ..quant.config import QuantConfig
from ..quant.precision import Candidate, choose_tiers
from ..quant.result import QuantResult, has_fp8, sensitivity
from .dead_code import eliminate_dead_code
from .fuse_projections import _fake_like, _param

aten = torch.ops.aten
SENSITIVITY_KINDS = {"loss": "estimated loss increase (output-gradient weighted)",
                     "relative": "relative output error (calibration has no output gradients)"}


def hf_name(target: str) -> str:
    """Graph attribute of a captured weight → HF module name (``m.model.layers.0.mlp.up_proj.weight``
    → ``model.layers.0.mlp.up_proj``)."""
    name = target[2:] if target.startswith("m.") else target
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _set_attr(gm: torch.fx.GraphModule, name: str, value: torch.Tensor, like: torch.fx.Node | None) -> torch.fx.Node:
    gm.register_buffer(name, value, persistent=False)
    node = gm.graph.get_attr(name)
    if like is not None:
        node.meta["val"] = _fake_like(like, value)
    return node


class AssignPrecision(Pass):
    name = "assign_precision"

    def __init__(self, result: QuantResult, qconfig: QuantConfig) -> None:
        super().__init__(qconfig)
        self.result = result
        self.qconfig = qconfig

    def _kernel(self, device: torch.device, dtype: torch.dtype) -> tuple[str, int, bool]:
        """(kernel, max_int4_tokens, keep a dense copy) for this device and activation dtype."""
        cfg = self.qconfig
        kernel = cfg.kernel
        if kernel == "auto":
            kernel = int4_op.default_kernel(device)
        int4_op.check_kernel(kernel, device)
        dense = cfg.dense_prefill and kernel in ("cpu", "cpu_c")
        if cfg.max_int4_tokens is not None:
            limit = cfg.max_int4_tokens
        elif dense:
            limit = int4_op.max_int4_tokens(kernel, dtype)
        else:
            limit = -1
        return kernel, (limit if dense else -1), dense

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        graph = gm.graph
        before = counted_nodes(gm)
        res = self.result
        info = ctx.info
        dtype, device = info.dtype, info.device
        elem = torch.empty((), dtype=dtype).element_size()
        cands: list[Candidate] = []
        for node in graph.nodes:
            if not is_call(node, aten.linear.default) or _param(gm, node.args[1]) is None:
                continue
            targets = node.meta.get("fused_weights") or [node.args[1].target]
            names = [hf_name(t) for t in targets]
            known = [n in res.linears for n in names]
            if not any(known):
                continue
            if not all(known):
                raise PassError(f"assign_precision: graph linear {node.name} computes {names}, but the quantized "
                                f"model covers only {[n for n, k in zip(names, known) if k]}")
            w = _param(gm, node.args[1])
            parts = [res.linears[n] for n in names]
            n_out = sum(p.shape[0] for p in parts)
            k = parts[0].shape[1]
            if tuple(w.shape) != (n_out, k) or any(p.shape[1] != k or p.group_size != parts[0].group_size for p in parts):
                raise PassError(f"assign_precision: graph linear {node.name} has weight {tuple(w.shape)}, the quantized "
                                f"parts {names} have shapes {[p.shape for p in parts]}")
            g = parts[0].group_size
            cands.append(Candidate(node, names, n_out, k, g, 0.0, n_out * k * elem, int4_op.int4_bytes(n_out, k, g, elem)))
        if not cands:
            raise PassError("assign_precision: no graph linear matches the quantized model's linears "
                            f"(e.g. {next(iter(res.linears), None)}); was it made for this model?")
        covered = {n for c in cands for n in c.names}
        uncovered = sorted(set(res.linears) - covered)
        if uncovered:
            raise PassError(f"assign_precision: {len(uncovered)} quantized linears have no linear in the graph, "
                            f"e.g. {uncovered[:3]}")
        tiers = self.qconfig.tiers
        if "fp8" in tiers and not has_fp8(res):
            raise PassError("assign_precision: tiers include 'fp8', but the quantized model has no FP8 weights "
                            "(quantize it with tiers including 'fp8', e.g. `quantize run --tiers int4,fp8`)")
        values, sens_kind = sensitivity(res, [c.names for c in cands])
        fp8_values = sensitivity(res, [c.names for c in cands], "fp8")[0] if "fp8" in tiers else [None] * len(cands)
        for c, v, v8 in zip(cands, values, fp8_values):
            c.sensitivity, c.fp8_sensitivity, c.fp8_bytes = v, v8, fp8_op.fp8_bytes(c.n, c.k)
        choice = choose_tiers(cands, self.qconfig.target, tiers)
        kernel, max_tokens, dense = self._kernel(device, dtype)
        fp8_kernel = fp8_op.default_kernel(device)
        packed_dense = device.type == "cpu" and prepack_supported(dtype)
        # no native half-precision GEMM on this CPU: the dense copy runs as float32 GEMMs
        upcast_dense = device.type == "cpu" and not packed_dense and dtype in (torch.bfloat16, torch.float16)
        fp8_dense = self.qconfig.dense_prefill and fp8_kernel == "cpu_c"
        fp8_max_tokens = fp8_op.max_fp8_tokens(dtype) if fp8_dense else -1
        rows = []
        dense_bytes = 0

        def dense_copy(i: int, tier: str, w: torch.Tensor, w_node: torch.fx.Node, kwargs: dict) -> None:
            """A dequantized dense copy (oneDNN-packed where this CPU has it) for steps above the limit."""
            nonlocal dense_bytes
            w = w.to(device)
            if packed_dense:
                w = torch.ops.mkldnn._reorder_linear_weight(w, 1)
                kwargs["dense_kernel"] = "mkldnn"
            elif upcast_dense:
                kwargs["dense_kernel"] = "upcast"
            kwargs["dense"] = _set_attr(gm, f"{tier}_{i}_dense", w, w_node)
            dense_bytes += cands[i].fp_bytes

        for i, c in enumerate(cands):
            node = c.node
            parts = [res.linears[n] for n in c.names]
            bias = node.args[2] if len(node.args) > 2 else None
            w_node = node.args[1]
            tier = choice[i]
            head = c.names == [res.head]
            if tier == "int4":
                q = torch.cat([p.q for p in parts])
                scale = torch.cat([p.scale for p in parts])
                minv = torch.cat([p.minv for p in parts])
                qw, sz = int4_op.prepare_operands(kernel, q, scale, minv, c.group_size, dtype, device)
                with graph.inserting_before(node):
                    qw_node = _set_attr(gm, f"int4_{i}_qweight", qw, w_node)
                    sz_node = _set_attr(gm, f"int4_{i}_scales_zeros", sz, w_node)
                    # the head only sees the rows that need logits (a few per step): no dense copy
                    kwargs = {"bias": bias, "max_int4_tokens": -1 if head else max_tokens}
                    if dense and not head:
                        dense_copy(i, tier, int4_op.dequantize(q, scale, minv, c.group_size, dtype), w_node, kwargs)
                    new = add_call(graph, torch.ops.devin.int4_linear.default,
                                   (node.args[0], qw_node, sz_node, c.group_size, c.n, kernel), kwargs, like=node)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
            elif tier == "fp8":
                q8 = torch.cat([p.fp8_q for p in parts])
                s8 = torch.cat([p.fp8_scale for p in parts])
                qw, sc = fp8_op.prepare_operands(fp8_kernel, q8, s8, device)
                with graph.inserting_before(node):
                    qw_node = _set_attr(gm, f"fp8_{i}_qweight", qw, w_node)
                    sc_node = _set_attr(gm, f"fp8_{i}_scale", sc, w_node)
                    limit = -1 if head else fp8_max_tokens
                    kwargs = {"bias": bias, "max_fp8_tokens": limit}
                    if limit >= 0:
                        dense_copy(i, tier, fp8_op.dequantize(q8, s8, dtype), w_node, kwargs)
                    new = add_call(graph, torch.ops.devin.fp8_linear.default,
                                   (node.args[0], qw_node, sc_node, c.n, fp8_kernel), kwargs, like=node)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
            elif any(p.in_scale is not None or p.row_scale is not None for p in parts):
                w = _param(gm, w_node)
                pieces, start = [], 0
                for p in parts:
                    pieces.append(p.fp_weight(w[start:start + p.shape[0]].detach()))
                    start += p.shape[0]
                with graph.inserting_before(node):
                    new_w = _set_attr(gm, f"awq_{i}_weight", torch.cat(pieces), w_node)
                node.replace_input_with(w_node, new_w)
            why = next((p.group_note for p in parts if p.group_note), "") if tier == "int4" else ""
            rows.append({"linear": _label(c.names), "graph_node": node.name,
                         "precision": tier if tier != "fp" else str(dtype).replace("torch.", ""),
                         "bits": {"int4": 4, "fp8": 8}.get(tier, elem * 8),
                         "group_size": c.group_size if tier == "int4" else None, "group_note": why,
                         "sensitivity": c.sensitivity, "fp8_sensitivity": c.fp8_sensitivity,
                         "sensitivity_kind": sens_kind,
                         "bytes": {"int4": c.int4_bytes, "fp8": c.fp8_bytes}.get(tier, c.fp_bytes), "params": c.params})
        self._apply_overrides(gm)
        eliminate_dead_code(gm)
        ctx.extras["precision_table"] = rows
        n4 = choice.count("int4")
        n8 = choice.count("fp8")
        ptot = sum(c.params for c in cands)
        p4 = sum(c.params for c, t in zip(cands, choice) if t == "int4")
        p8 = sum(c.params for c, t in zip(cands, choice) if t == "fp8")
        total_bytes = sum(r["bytes"] for r in rows)
        fp_bytes = sum(c.fp_bytes for c in cands)
        groups = sorted({(c.group_size, r["group_note"]) for c, r in zip(cands, rows) if r["precision"] == "int4"})
        gnote = "; ".join(f"g{g}" + (f" ({why})" if why else "") for g, why in groups)
        dense_kind = "oneDNN " if dense and packed_dense else "float32-GEMM " if dense and upcast_dense else ""
        mode = (f"{kernel} kernel for steps of <= {max_tokens} tokens, dense {dense_kind}copy above"
                if dense and max_tokens > 0 else "dense dequantized copy for every step (fp32: the CPU int4 kernel "
                "has no fast fp32 path)" if dense else f"{kernel} kernel for every step")
        if n8:
            mode += (f"; FP8 {fp8_kernel} kernel" + (f" for steps of <= {fp8_max_tokens} tokens, dense copy above"
                                                     if fp8_dense else " for every step"))
        what = "decoder-linear + lm_head" if res.head else "decoder-linear"
        tiers_note = f"FP8 {n8}/{len(cands)} linears ({p8 / ptot:.1%}), " if "fp8" in tiers else ""
        note = (f"{res.method} INT4 {n4}/{len(cands)} linears ({p4 / ptot:.1%} of {what} weights), {tiers_note}"
                f"target {self.qconfig.target['kind']}"
                + (f"={self.qconfig.target['value']}" if self.qconfig.target["value"] is not None else "")
                + f"; {what} weights {total_bytes / 2**20:.1f} MiB vs {fp_bytes / 2**20:.1f} MiB"
                + (f" (+ {dense_bytes / 2**20:.1f} MiB dense copies for long steps: dense_prefill=False drops them)"
                   if dense_bytes else "")
                + (f"; {gnote}" if gnote else "") + f"; sensitivity: {SENSITIVITY_KINDS[sens_kind]}; {mode}; "
                f"{node_delta(gm, before)}")
        return PassResult(matches=n4 + n8, note=note, details=precision_table_markdown(rows))

    def _apply_overrides(self, gm: torch.fx.GraphModule) -> None:
        for j, (pname, value) in enumerate(sorted(self.result.overrides.items())):
            nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "m." + pname]
            if not nodes:
                raise PassError(f"assign_precision: the graph never reads {pname}, which AWQ rescaled")
            old = _param(gm, nodes[0])
            attr = f"awq_override_{j}"
            gm.register_buffer(attr, value.to(device=old.device, dtype=old.dtype), persistent=False)
            for n in nodes:
                n.target = attr


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
        s8 = f"{r['fp8_sensitivity']:.2e} | " if fp8 else ""
        lines.append(f"| {r['linear']} | {r['precision']} | {g} | {r['sensitivity']:.2e} | {s8}{r['bytes']} |")
    notes = sorted({r["group_note"] for r in rows if r["group_note"]})
    lines.extend(f"\n\\* {n}" for n in notes)
    return "\n".join(lines)
