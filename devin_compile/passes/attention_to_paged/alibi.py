"""Classify the additive terms of an attention core: a plain mask, or an ALiBi bias (per-head slopes).

attention_to_paged drops every term added to the scores (the runtime applies causality and
windows itself). That is only right for a *mask*: a term that is 0 on every key a query may
see. Families differ in how they build the ALiBi bias (BLOOM: ``baddbmm(slopes·arange(T), q, kᵀ)``;
MPT: a ``max_seq_len``-long table sliced to T; Falcon ``alibi=True``: the bias folded into the
float mask), so instead of matching each construction, the terms' subgraph is *evaluated* on
a probe of ``PROBE_LEN`` tokens (positions 0..P-1) and the sum read back:

- 0 on every visible entry (j <= i and not masked out), up to a per-row constant: a plain mask, nothing to keep;
- ``c_i + slope_h · (j - i)`` on the visible entries: ALiBi with the least-squares slopes;
- anything else: :class:`PassError` naming the layer (a bias the paged runtime cannot apply).

The per-row constant is free because softmax is shift invariant per row. Invariant: the slopes
reproduce the evaluated bias within ``1e-4`` of its largest visible magnitude (and 1e-5 absolute).
"""
from __future__ import annotations

import torch
import torch.fx

from ...pipeline import PassError

PROBE_LEN = 64


class SubgraphEvaluator:
    """Evaluates nodes of a captured graph on concrete probe inputs (memoised across calls).

    Placeholders get ``input_ids = 0`` [1, P], ``position_ids = arange(P)`` [1, P] and
    ``logits_indices = arange(P)``; only the ancestors of the requested node run.
    """

    def __init__(self, gm: torch.fx.GraphModule, length: int, device: torch.device | str = "cpu") -> None:
        self.gm, self.P, self.device = gm, length, torch.device(device)
        self.env: dict[torch.fx.Node, object] = {}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def _placeholder(self, node: torch.fx.Node) -> torch.Tensor:
        P = self.P
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        idx = placeholders.index(node)
        if idx == 0:
            return torch.zeros((1, P), dtype=torch.long, device=self.device)
        if idx == 1:
            return torch.arange(P, device=self.device)[None]
        return torch.arange(P, device=self.device)

    def value(self, node: object) -> object:
        if not isinstance(node, torch.fx.Node):
            return node
        if node in self.env:
            return self.env[node]
        todo, seen, stack = [], set(), [node]
        while stack:  # ancestors not yet evaluated
            n = stack.pop()
            if n in seen or n in self.env:
                continue
            seen.add(n)
            todo.append(n)
            stack.extend(n.all_input_nodes)
        for n in sorted(todo, key=self.order.__getitem__):
            if n.op == "placeholder":
                self.env[n] = self._placeholder(n)
            elif n.op == "get_attr":
                obj = self.gm
                for part in n.target.split("."):
                    obj = getattr(obj, part)
                self.env[n] = obj
            elif n.op == "call_function":
                args = torch.fx.node.map_arg(n.args, self.env.__getitem__)
                kwargs = torch.fx.node.map_arg(n.kwargs, self.env.__getitem__)
                self.env[n] = n.target(*args, **kwargs)
            else:
                raise RuntimeError(f"cannot evaluate {n.op} node {n.name}")
        return self.env[node]


def fit_alibi(bias: torch.Tensor, num_heads: int, where: str) -> torch.Tensor | None:
    """``bias`` [H or 1, P, P] (the summed additive terms on a P-token probe) → per-head slopes
    [num_heads] (float32) if it is ALiBi, None if it is a plain mask; else :class:`PassError`."""
    P = bias.shape[-1]
    b = bias.double()
    # visible: causal and not masked out (masks use -inf or the dtype's min; windows hide old keys)
    vis = torch.ones(P, P, dtype=torch.bool).tril() & (b > -1e30)
    if not bool(torch.diagonal(vis, dim1=-2, dim2=-1).all()):
        raise PassError(f"{where}: the terms added to the attention scores hide a token from itself; cannot serve them")
    rel = b - torch.diagonal(b, dim1=-2, dim2=-1)[..., :, None]  # minus each row's own (diagonal) entry
    d = (torch.arange(P)[None, :] - torch.arange(P)[:, None]).double().expand_as(b)  # j - i
    rel = torch.where(vis, rel, torch.zeros((), dtype=b.dtype))
    if not torch.isfinite(rel).all():
        raise PassError(f"{where}: the attention bias is not finite on visible keys; cannot serve it")
    magnitude = float(torch.where(vis, b, torch.zeros((), dtype=b.dtype)).abs().max())
    tol = max(1e-5, 1e-4 * magnitude)
    if float(rel.abs().max()) <= tol:
        return None
    dv = torch.where(vis, d, torch.zeros((), dtype=d.dtype))
    slopes = (rel * dv).sum((-2, -1)) / (dv * dv).sum((-2, -1)).clamp_min(1.0)
    resid = float((rel - slopes[:, None, None] * dv).abs().max())
    if resid > tol:
        raise PassError(
            f"{where}: an additive attention bias that is neither a mask nor ALiBi (slope·(key − query) per head; "
            f"it departs from the best linear fit by {resid:.3g}); the paged runtime cannot apply it"
        )
    if slopes.numel() == 1:
        slopes = slopes.expand(num_heads)
    if slopes.numel() != num_heads:
        raise PassError(f"{where}: ALiBi bias with {slopes.numel()} heads, expected {num_heads} query heads")
    return slopes.float().contiguous()


def additive_bias(ev: SubgraphEvaluator, terms: list[tuple[torch.fx.Node, float, int]]) -> torch.Tensor | None:
    """Sum of the evaluated ``(node, coefficient, heads)`` terms as [H or 1, P, P] float64, or None.

    Each term broadcasts against [heads, P, P] (a 4-D term against [1, heads, P, P]); bool
    terms (masks for ``masked_fill``/SDPA) are not additive and are skipped."""
    P, total = ev.P, None
    for node, coef, heads in terms:
        val = ev.value(node)
        if not isinstance(val, torch.Tensor) or val.dtype == torch.bool:
            continue
        full = val.double() * coef
        shape = (1, heads, P, P) if full.dim() == 4 else (heads, P, P)
        full = full.expand(shape).reshape(heads, P, P)
        total = full if total is None else total + full
    return total
