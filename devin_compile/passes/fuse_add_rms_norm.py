"""fuse_add_rms_norm (CPU): a residual add and the RMSNorm that reads it → one ``devin::add_rms_norm``.

Pattern (after :mod:`.fuse_rms_norm`; a pre-norm decoder has one per layer boundary and one per
attention → MLP handover)::

    s = add(x, residual)                 # same shape and dtype, no alpha
    y = devin.rms_norm(s, w, eps)

→ ``y, s = devin::add_rms_norm(x, residual, w, eps)`` (``s`` still feeds the next residual add).
Two dispatched ops become one, and on CPU the op's C++ kernel adds and normalises the row in one
pass: 60 fewer dispatched ops per SmolLM2 step. Invariant: bit-identical (the sum is rounded to
the dtype once, like aten's add, and the norm is ``devin::rms_norm``'s kernel). Runs late (after
``assign_precision``, which reads norms to fold AWQ scales, and ``cleanup``); skipped off CPU and
without the C++ kernel (the op's Python kernel would cost more than the two ops), and
``compile_decode`` gives Inductor the add and ``aten.rms_norm`` back.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..graph_utils import add_call, eliminate_dead_code, fake_value, is_call, replace_matches
from ..ops import rms_norm as rms_norm_op  # registers devin::rms_norm and devin::add_rms_norm
from ..pipeline import Pass, PassContext, PassResult, Program

aten = torch.ops.aten


def _match(norm: torch.fx.Node, order: dict[torch.fx.Node, int]):
    """rms_norm(add(a, b), w, eps) → (a, b), when a and b share s's shape and dtype and every other
    user of s comes after the norm (it reads the fused op's second output)."""
    if not is_call(norm, torch.ops.devin.rms_norm.default):
        return None
    s = norm.args[0]
    if not is_call(s, aten.add.Tensor) or len(s.args) != 2 or s.kwargs:
        return None
    a, b = s.args
    vs, va, vb = fake_value(s), fake_value(a), fake_value(b)
    if not all(isinstance(v, torch.Tensor) for v in (vs, va, vb)) or vs.device.type != "cpu":
        return None
    if va.shape != vs.shape or vb.shape != vs.shape or not (va.dtype == vb.dtype == vs.dtype):
        return None
    if any(order.get(u, -1) < order[norm] for u in s.users if u is not norm):
        return None
    return a, b


def _build(graph: torch.fx.Graph, norm: torch.fx.Node, operands) -> torch.fx.Node:
    a, b = operands
    s = norm.args[0]
    fused = add_call(graph, torch.ops.devin.add_rms_norm.default, (a, b, *norm.args[1:]), like=norm)
    y = add_call(graph, operator.getitem, (fused, 0), like=norm)
    summed = add_call(graph, operator.getitem, (fused, 1), like=s)
    s.replace_all_uses_with(summed)  # the norm (removed next) and the later residual adds
    return y


class FuseAddRMSNorm(Pass):
    name = "fuse_add_rms_norm"

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if ctx.info is not None and ctx.info.device.type != "cpu":
            return "the fused op has a C++ kernel on CPU only"
        if not rms_norm_op.load_cpu_kernel():
            return "no C++ compiler for devin::add_rms_norm's kernel"
        return None

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        replaced: list[torch.fx.Node] = []

        def matches():
            for norm in list(gm.graph.nodes):
                if (m := _match(norm, order)) is not None:
                    replaced.append(norm)
                    yield norm, m
        done = replace_matches(gm, matches(), _build)
        for norm in replaced:  # dead now, but devin:: ops count as side effects, so DCE keeps them
            gm.graph.erase_node(norm)
        eliminate_dead_code(gm)  # then the adds they read
        return PassResult(matches=done.count, note=f"{done.count} residual adds fused into the next norm; "
                                                   f"{done.delta(gm)}")
