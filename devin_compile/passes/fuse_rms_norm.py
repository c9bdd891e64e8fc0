"""fuse_rms_norm: Hugging Face's RMSNorm op chain → one ``devin::rms_norm`` call.

Pattern (Llama-style ``RMSNorm.forward``, as torch.export records it)::

    h = x.to(float32)                         # optional (absent when x is float32)
    y = w * (h * rsqrt(mean(h ** 2, -1, keepdim=True) + eps)).to(x.dtype)

→ ``devin::rms_norm(x, w, eps)`` over the last dimension (:mod:`~devin_compile.ops.rms_norm`:
``aten.rms_norm``'s math; on CPU a C++ kernel, loaded here, does it in one pass).

Eight dispatched ops become one, with float32 math. Invariant: equal in float32 up to the
rounding of the mean of squares (the CPU kernel sums it in double); in bf16/fp16 the weight multiply happens before the final
rounding instead of after it (one rounding instead of two). Norms of other shapes (Gemma's
``1 + w``, LayerNorm) do not match and are left alone. ``compile_decode`` turns the op back
into ``aten.rms_norm`` for Inductor.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import add_call, commuted, each_match, fake_value, is_call, replace_matches
from ..ops import rms_norm as rms_norm_op  # registers devin::rms_norm
from ..pipeline import Pass, PassContext, PassResult

aten = torch.ops.aten
_CAST = (aten.to.dtype, aten._to_copy.default)


def _strip_cast(n):
    return n.args[0] if is_call(n, *_CAST) else n


def _match(mul_w: torch.fx.Node):
    """mul(w, normed) or mul(normed, w) → (x, w, eps) or None."""
    for w, normed in commuted(mul_w, aten.mul.Tensor):
        if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
            continue
        n = _strip_cast(normed)
        if not is_call(n, aten.mul.Tensor):
            continue
        h, r = n.args
        if not is_call(r, aten.rsqrt.default):
            h, r = r, h
        if not is_call(r, aten.rsqrt.default) or not is_call(r.args[0], aten.add.Tensor):
            continue
        m, eps = r.args[0].args
        if not (is_call(m, aten.mean.dim) and isinstance(eps, float) and list(m.args[1]) in ([-1], [fake_value(h).dim() - 1])):
            continue
        p = m.args[0]
        if not (is_call(p, aten.pow.Tensor_Scalar) and p.args[0] is h and p.args[1] == 2):
            continue
        x = _strip_cast(h)
        wv, xv = fake_value(w), fake_value(x)
        if wv is None or xv is None or wv.dim() != 1 or wv.shape[0] != xv.shape[-1]:
            continue
        return x, w, eps
    return None


def _build(graph: torch.fx.Graph, node: torch.fx.Node, match) -> torch.fx.Node:
    x, w, eps = match
    out_dtype = fake_value(node).dtype
    if fake_value(x).device.type == "cpu":
        rms_norm_op.load_cpu_kernel()
    y = add_call(graph, torch.ops.devin.rms_norm.default, (x, w, eps), like=node)
    if fake_value(y).dtype != out_dtype:
        y = add_call(graph, aten.to.dtype, (y, out_dtype), like=node)
    return y


class FuseRMSNorm(Pass):
    name = "fuse_rms_norm"

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        done = replace_matches(gm, each_match(gm, _match), _build)
        return PassResult(matches=done.count, note=f"{done.count} RMSNorms fused; {done.delta(gm)}")
