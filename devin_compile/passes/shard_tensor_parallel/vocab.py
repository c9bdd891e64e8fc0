"""shard_tensor_parallel's vocabulary split: the logits linear and the token embedding, by vocabulary rows.

V rows over N ranks in shards of S = ⌈V/N⌉ rows: rank r holds rows [r·S, min((r+1)·S, V)), its copy
padded with zero rows to S (as vLLM does), so every rank's shard and logits slice have one shape.

Pattern → replacement::

    y = linear(h, W[V, H][, b])  →  p = linear(h, W_r[S, H][, b_r])                         # [d0, …, S]
                                    g = wait(all_gather_into_tensor(p, N, group))            # [N·d0, …, S]
                                    y = flatten(movedim(unflatten(g, 0, [N, -1]), 0, -2), -2, -1)[..., :V]
    x = embedding(W, ids)        →  i = ids − r·S;  off = (i < 0) | (i ≥ |rows_r|)
                                    x = wait(all_reduce(masked_fill(embedding(W_r, masked_fill(i, off, 0)),
                                                                    off[..., None], 0), sum))

Which: every logits linear (``graph_utils.is_logits_linear``); every embedding lookup of a table a
logits linear reads (tied, as SmolLM2: the lookup reads the head's shard, one tensor); and, untied,
the token embedding (the lookup of the ``input_ids`` placeholder). An untied token embedding is
split too: it is as large as the head (V·H), and splitting it costs one all_reduce of [T, H] per step,
where the layers already pay two each. Other lookups (learned position embeddings) stay whole on
every rank; the report counts them.

Invariants: every rank ends with the unsplit logits (each logit is one rank's dot product; the padded
columns are cut off) and exactly the unsplit embedding rows (each row comes from one rank, the
others add zeros). A table read by anything but logits linears and embedding lookups is a
:class:`PassError` naming the reader, raised while planning, before any weight is split.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ...config.tensor_parallel import TensorParallelSpec
from ...config.weight_slice import WeightSlice
from ...graph_utils import add_call, is_call, is_logits_linear, linear_bias, param_of
from ...pipeline import PassError
from .plan import module_of
from .rewrite import set_tensor, sum_over_ranks, tensor_of

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


@dataclass
class VocabShard:
    """One vocabulary table [V, H] split by rows: the ``get_attr`` nodes that read it (one per name it
    has), the logits linears and the embedding lookups among their readers."""

    weights: list[torch.fx.Node]
    heads: list[torch.fx.Node]
    lookups: list[torch.fx.Node]
    size: int  # V, the table's rows before the split

    @property
    def path(self) -> str:
        return module_of((self.heads or self.lookups)[0])


def plan_vocab(gm: torch.fx.GraphModule, heads: list[torch.fx.Node]) -> tuple[list[VocabShard], int]:
    """The tables to split (of the logits linears ``heads``, and the token embedding's) and how many
    other embedding lookups stay whole; a :class:`PassError` for a table read by anything else."""
    ids = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids"), None)
    lookups = [n for n in gm.graph.nodes if is_call(n, aten.embedding.default)]
    tables: dict[int, torch.Tensor] = {}
    for head in heads:
        t = param_of(gm, head.args[1])
        tables.setdefault(id(t), t)
    for lookup in lookups:
        t = param_of(gm, lookup.args[0])
        if t is not None and ids is not None and lookup.args[1] is ids:
            tables.setdefault(id(t), t)
    shards = [_table(gm, t) for t in tables.values()]
    split = {n for s in shards for n in s.lookups}
    return shards, sum(n not in split for n in lookups)


def _table(gm: torch.fx.GraphModule, table: torch.Tensor) -> VocabShard:
    """Every reader of ``table``, each a logits linear or an embedding lookup, or a :class:`PassError`."""
    weights = [n for n in gm.graph.nodes if n.op == "get_attr" and param_of(gm, n) is table]
    heads, lookups = [], []
    for w in weights:
        for user in w.users:
            if is_call(user, aten.linear.default) and user.args[1] is w and is_logits_linear(user):
                heads.append(user)
            elif is_call(user, aten.embedding.default) and user.args[0] is w:
                lookups.append(user)
            else:
                raise PassError(f"{module_of(user)}: {user.name} ({user.target}) reads {w.target}, the vocabulary "
                                "table that shard_tensor_parallel splits by rows over the ranks for the logits linear "
                                "and the embedding; only logits linears and embedding lookups may read it")
    if table.dim() != 2:
        raise PassError(f"{weights[0].target}: a vocabulary table of shape {tuple(table.shape)}, expected [V, H]")
    for head in heads:
        bias = linear_bias(head)
        alone = isinstance(bias, torch.fx.Node) and bias.op == "get_attr" and len(bias.users) == 1
        if bias is not None and not alone:
            raise PassError(f"{module_of(head)}: the logits linear's bias is not a weight of the graph that it alone "
                            "reads; cannot split it by vocabulary rows")
    return VocabShard(weights, heads, lookups, table.shape[0])


def split_vocab(gm: torch.fx.GraphModule, shard: VocabShard, spec: TensorParallelSpec) -> list[torch.fx.Node]:
    """Rewrite ``shard``'s readers (see the module docstring); the ``get_attr`` nodes whose tensors changed."""
    full = param_of(gm, shard.weights[0])
    size = shard.size
    rows, per = spec.vocab_rows(size)
    cut = WeightSlice(0, (rows,), size, per)  # recorded for assign_precision (a quantized head)
    stored = cut.take(full)
    for w in shard.weights:  # a tied table under two names: both read one shard
        stored = set_tensor(gm, w, stored, tied=True)
        w.meta["tp_slice"] = cut
    changed = list(shard.weights)
    for head in shard.heads:
        bias = linear_bias(head)
        if bias is not None:
            set_tensor(gm, bias, cut.take(tensor_of(gm, bias)))
            bias.meta["tp_slice"] = cut
            changed.append(bias)
        gather_logits(gm, head, spec, size, per)
    for lookup in shard.lookups:
        lookup_rows(gm, lookup, rows, spec.group_name)
    return changed


def gather_logits(gm: torch.fx.GraphModule, head: torch.fx.Node, spec: TensorParallelSpec, size: int,
                  per: int) -> torch.fx.Node:
    """Every user of ``head`` (this rank's ``per`` logits columns) now reads all ranks' columns side by
    side, cut to ``size``; returns the node of the full logits."""
    n = spec.world_size
    steps = [(_c10d.all_gather_into_tensor.default, (n, spec.group_name)), (_c10d.wait_tensor.default, ()),
             (aten.unflatten.int, (0, [n, -1])), (aten.movedim.int, (0, -2)), (aten.flatten.using_ints, (-2, -1))]
    if n * per != size:
        steps.append((aten.slice.Tensor, (-1, 0, size)))
    users = list(head.users)
    out = head
    for target, rest in steps:
        with gm.graph.inserting_after(out):
            out = add_call(gm.graph, target, (out, *rest), like=head)
    for user in users:
        user.replace_input_with(head, out)
    return out


def lookup_rows(gm: torch.fx.GraphModule, lookup: torch.fx.Node, rows: range, group_name: str) -> torch.fx.Node:
    """``lookup`` (an embedding of this rank's shard, whose row 0 is vocabulary row ``rows.start``) reads
    only ids in ``rows``, its other rows zeroed, summed over the ranks; returns the node of the sum."""
    graph = gm.graph
    weight, ids = lookup.args[:2]
    with graph.inserting_before(lookup):
        local = add_call(graph, aten.sub.Scalar, (ids, rows.start), like=lookup)
        below = add_call(graph, aten.lt.Scalar, (local, 0), like=lookup)
        above = add_call(graph, aten.ge.Scalar, (local, len(rows)), like=lookup)
        off = add_call(graph, aten.logical_or.default, (below, above), like=lookup)
        safe = add_call(graph, aten.masked_fill.Scalar, (local, off, 0), like=lookup)
    lookup.args = (weight, safe)  # padding_idx (a global id) does not change the forward
    users = list(lookup.users)
    with graph.inserting_after(lookup):
        off_rows = add_call(graph, aten.unsqueeze.default, (off, -1), like=lookup)
    with graph.inserting_after(off_rows):
        zeroed = add_call(graph, aten.masked_fill.Scalar, (lookup, off_rows, 0.0), like=lookup)
    for user in users:
        user.replace_input_with(lookup, zeroed)
    return sum_over_ranks(gm, zeroed, group_name)


def vocab_params(shards: list[VocabShard]) -> list[torch.fx.Node]:
    """The ``get_attr`` nodes of the split tables and of the logits linears' biases."""
    return [n for s in shards for n in (*s.weights, *(linear_bias(h) for h in s.heads)) if isinstance(n, torch.fx.Node)]
