"""shard_tensor_parallel: this rank's share of every decoder layer (Megatron-style tensor parallelism).

Pattern → replacement, per attention layer (``devin::paged_attention`` over q [T, Hq, D]) and MLP
(which linears these are is read from the dataflow: ``plan.py``)::

    q|k|v = linear(x, W)            →  linear(x, W[rank's heads · D])          # column-parallel
    out   = linear(a, W_o[, b])     →  wait(all_reduce(linear(a, W_o[:, rank's q heads · D]), sum))[+ b]
    gate|up = linear(x, W)          →  linear(x, W[rank's I/N rows])            # column-parallel
    down  = linear(h, W_d[, b])     →  wait(all_reduce(linear(h, W_d[:, rank's I/N cols]), sum))[+ b]
    experts: W_gate_up [E, 2F, H]   →  W_gate_up[:, rank's F/N gate rows ++ its F/N up rows]
             W_down [E, H, F]       →  W_down[:, :, rank's F/N cols];  out = slot sum → wait(all_reduce(out, sum))
    logits = linear(h, W[V, H][, b]) → all ranks' linear(h, W[rank's ⌈V/N⌉ rows, zero-padded]) side by side
                                       (wait(all_gather_into_tensor(·)) put back to [..., V])   # vocab-parallel
    x = embedding(W, ids)           →  wait(all_reduce(embedding(W[rank's rows], ids − start), zero outside, sum))

Rank r holds whole GQA groups (a contiguous run of KV heads and the query heads that read them; the
first ``Hkv mod N`` ranks one group more, SmolLM2's 3 groups at N=2 as 2 + 1), or, with fewer KV heads
than ranks, ``Hq/N`` query heads and a copy of the one KV head they share (``config/tensor_parallel.py``),
so each ``paged_attention`` sees the rank's query and KV heads, and the rank's KV pool holds
only those (the runtime builds it from the rank-local ``ModelInfo``). Per-head constants of the op
(ALiBi slopes, attention sinks) keep the rank's heads. Routed experts (Mixtral & co.) keep every
expert on every rank with 1/N of its intermediate features; the router stays whole, so each rank
routes every token exactly as one process does. The logits linear and the token embedding are
vocab-parallel (``vocab.py``): rank r keeps rows [r·S, (r+1)·S) of their tables, S = ⌈V/N⌉ (padded
with zero rows); every rank gathers the full logits (rank 0 samples them); a table tied to both
(SmolLM2) is one shard that both read. Norms (and other embedding lookups, e.g. learned positions)
stay whole on every rank.
The collectives are ``torch.ops._c10d_functional`` (gloo on CPU, NCCL on CUDA) over the process
group named in :class:`~devin_compile.config.tensor_parallel.TensorParallelSpec`.

Invariant: the sum over ranks of each row-parallel linear's partial output equals the unsplit
linear's output (up to float summation order), the gathered logits and summed embedding rows are
the unsplit ones, so every rank's logits match one process. A linear that is none of the above, a
fused q/k/v projection, a vocabulary table read by anything but logits linears and embedding lookups,
or a view that hard-codes a head count is a :class:`PassError` naming the module; nothing is
replicated silently. The report gives the bytes of every split weight (vocabulary tables included,
a tied one once) on this rank and unsplit. Every cut is recorded on its ``get_attr``
(``meta["tp_slice"]``, a :class:`~devin_compile.config.weight_slice.WeightSlice`) for ``assign_precision``,
which cuts a quantized model's tensors alike; with one, row-parallel cuts must keep whole INT4 groups
(``quant_groups.py``: a :class:`PassError` naming the layer and the group size, while planning).
"""
from __future__ import annotations

import torch
import torch.fx

from ...capture import ModelInfo
from ...config.tensor_parallel import HeadShard, TensorParallelSpec
from ...graph_utils import counted_nodes, eliminate_dead_code, linear_bias, node_delta
from ...pipeline import Pass, PassContext, PassError, PassResult
from .plan import AttentionShard, ExpertsShard, ShardPlan, module_of, plan_shards
from .quant_groups import check_group_boundaries
from .rewrite import column_parallel, keep, refresh_shapes, row_parallel, sum_over_ranks, tensor_of
from .vocab import VocabShard, plan_vocab, split_vocab, vocab_params


class ShardTensorParallel(Pass):
    name = "shard_tensor_parallel"
    requires = ("attention_to_paged",)

    def __init__(self, spec: TensorParallelSpec, groups: dict[str, int] | None = None) -> None:
        super().__init__(spec)
        self.groups = groups  # a quantized model's INT4 group size per linear (HF name): row cuts must keep whole groups

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        spec: TensorParallelSpec = self.config
        info = ctx.info
        if info is None:
            raise PassError("shard_tensor_parallel needs the model's ModelInfo (optimize() gives it)")
        try:
            heads = spec.heads(info.num_heads, info.num_kv_heads)
        except ValueError as e:
            raise PassError(str(e)) from None
        before = counted_nodes(gm)
        eliminate_dead_code(gm)  # export's shape asserts would check the unsplit sizes
        plan = plan_shards(gm)
        vocab, whole_lookups = plan_vocab(gm, plan.heads)  # planned (and refused) before any weight is split
        cuts = _layer_cuts(gm, plan, spec, heads, info)
        check_group_boundaries(cuts[1], self.groups, spec)
        full = _weight_bytes(gm, plan, vocab)
        changed = _split_layers(gm, plan, spec, heads, cuts)
        for block in plan.experts:
            changed.update(_split_experts(gm, block, spec))
        for table in vocab:
            changed.update(split_vocab(gm, table, spec))
        refresh_shapes(gm, changed)
        local = _weight_bytes(gm, plan, vocab)
        n_row = len(plan.attention) + len(plan.mlps)
        moe = (f", {len(plan.experts)} expert blocks split by intermediate features ({len(plan.experts)} all_reduce, "
               "routers replicated)") if plan.experts else ""
        return PassResult(
            matches=len(plan.linears()) + len(plan.experts) + len(vocab),
            note=(f"rank {spec.rank}/{spec.world_size}: {len(plan.linears()) - n_row} column-parallel and {n_row} "
                  f"row-parallel linears ({n_row} all_reduce){moe}, {len(heads.q)} query / {len(heads.kv)} KV heads "
                  f"per layer, {_vocab_note(vocab, whole_lookups, spec)}; split weights {local} of {full} "
                  f"bytes on this rank; {node_delta(gm, before)}"))


def _layer_cuts(gm: torch.fx.GraphModule, plan: ShardPlan, spec: TensorParallelSpec, heads: HeadShard,
                info: ModelInfo) -> tuple[list[tuple[torch.fx.Node, range]], list[tuple[torch.fx.Node, range, int]]]:
    """Attention layers by heads and MLPs by intermediate features, checked but not yet applied:
    (column-parallel linear, its output rows) and (row-parallel linear, its input columns, K)."""
    columns: list[tuple[torch.fx.Node, range]] = []
    rows: list[tuple[torch.fx.Node, range, int]] = []
    D = info.head_dim
    for layer in plan.attention:
        _check_widths(gm, layer, info.num_heads * D, info.num_kv_heads * D)
        q_cols = range(heads.q.start * D, heads.q.stop * D)
        kv_rows = range(heads.kv.start * D, heads.kv.stop * D)
        columns += [(layer.q, q_cols), (layer.k, kv_rows), (layer.v, kv_rows)]
        rows.append((layer.o, q_cols, info.num_heads * D))
    for mlp in plan.mlps:
        width = tensor_of(gm, mlp.row.args[1]).shape[1]
        if width % spec.world_size:
            raise PassError(f"{mlp.path}: intermediate size {width} does not split over "
                            f"tensor_parallel={spec.world_size} ranks")
        for lin in mlp.columns:
            if tensor_of(gm, lin.args[1]).shape[0] != width:
                raise PassError(f"{module_of(lin)}: {tensor_of(gm, lin.args[1]).shape[0]} output features, but "
                                f"{module_of(mlp.row)} reads {width}; cannot split them alike")
            columns.append((lin, spec.rows(width)))
        rows.append((mlp.row, spec.rows(width), width))
    return columns, rows


def _split_layers(gm: torch.fx.GraphModule, plan: ShardPlan, spec: TensorParallelSpec, heads: HeadShard,
                  cuts: tuple[list, list]) -> set[torch.fx.Node]:
    """Apply :func:`_layer_cuts` (and keep each attention op's per-head constants of the rank's query
    heads); the ``get_attr`` nodes whose tensors changed."""
    columns, rows = cuts
    for lin, keep_rows in columns:
        column_parallel(gm, lin, keep_rows)
    changed: set[torch.fx.Node] = set(_params(*(lin for lin, _ in columns), *(lin for lin, _, _ in rows)))
    for layer in plan.attention:
        changed.update(_head_constants(gm, layer.attention, heads.q))
    for lin, cols, _ in rows:
        row_parallel(gm, lin, cols, spec.group_name)
    return changed


def _vocab_note(vocab: list[VocabShard], whole_lookups: int, spec: TensorParallelSpec) -> str:
    """The report's words on the vocabulary split: what each table serves, its rows per rank, the
    collectives, the lookups left whole."""
    parts = []
    for table in vocab:
        rows, per = spec.vocab_rows(table.size)
        what = " + ".join(x for x in (f"{len(table.heads)} logits linear" if table.heads else "",
                                      f"{len(table.lookups)} embedding" if table.lookups else "") if x)
        tied = " (tied: one shard)" if table.heads and table.lookups else ""
        pad = f", {per - len(rows)} zero padding row(s) here" if per > len(rows) else ""
        parts.append(f"{what}{tied} split by vocabulary rows, {per} of {table.size} per rank{pad}")
    gathers, reduces = sum(len(t.heads) for t in vocab), sum(len(t.lookups) for t in vocab)
    if not parts:
        return f"no vocabulary table split, {whole_lookups} embedding lookups replicated"
    return f"{'; '.join(parts)} ({gathers} all_gather, {reduces} all_reduce), {whole_lookups} other embedding " \
           "lookups replicated"


def _split_experts(gm: torch.fx.GraphModule, block: ExpertsShard, spec: TensorParallelSpec) -> list[torch.fx.Node]:
    """Every expert keeps this rank's F/N intermediate features: gate and up rows alike (W_gate_up holds
    gate then up, which the graph chunks in two), the same down columns; the slot sum is summed over ranks."""
    f = tensor_of(gm, block.down).shape[2]
    if f % spec.world_size or tensor_of(gm, block.gate_up).shape[1] != 2 * f:
        raise PassError(f"{block.path}: expert intermediate size {f} does not split over "
                        f"tensor_parallel={spec.world_size} ranks")
    rows = spec.rows(f)
    keep(gm, block.gate_up, [rows, range(f + rows.start, f + rows.stop)], 1)
    keep(gm, block.down, rows, 2)
    sum_over_ranks(gm, block.out, spec.group_name)
    return [block.gate_up, block.down]


def _params(*linears: torch.fx.Node) -> list[torch.fx.Node]:
    return [n for lin in linears for n in (lin.args[1], linear_bias(lin)) if isinstance(n, torch.fx.Node)]


def _weight_bytes(gm: torch.fx.GraphModule, plan: ShardPlan, vocab: list[VocabShard]) -> int:
    """Bytes of the weights (and biases) the pass splits: the plan's linears and experts, and the
    vocabulary tables (a tied table counted once)."""
    nodes = set(_params(*plan.linears())) | {n for e in plan.experts for n in (e.gate_up, e.down)}
    tensors = {id(t): t for t in (tensor_of(gm, n) for n in (*nodes, *vocab_params(vocab)))}
    return sum(t.nbytes for t in tensors.values())


def _check_widths(gm: torch.fx.GraphModule, layer: AttentionShard, q_width: int, kv_width: int) -> None:
    """q/k/v weights have Hq·D / Hkv·D rows and the output projection Hq·D columns, as ModelInfo says."""
    rows = {"query": (layer.q, q_width), "key": (layer.k, kv_width), "value": (layer.v, kv_width)}
    for what, (lin, width) in rows.items():
        got = tensor_of(gm, lin.args[1]).shape[0]
        if got != width:
            raise PassError(f"{layer.path}: the {what} projection has {got} output features, expected {width} "
                            "(heads × head_dim); cannot split its heads")
    got = tensor_of(gm, layer.o.args[1]).shape[1]
    if got != q_width:
        raise PassError(f"{layer.path}: the output projection reads {got} features, expected {q_width}")


def _head_constants(gm: torch.fx.GraphModule, attention: torch.fx.Node, q_heads: range) -> list[torch.fx.Node]:
    """The op's per-query-head constants (ALiBi slopes: 8th argument; ``sinks=``) keep the rank's heads."""
    nodes = [attention.args[8]] if len(attention.args) > 8 else []
    nodes += [attention.kwargs["sinks"]] if attention.kwargs.get("sinks") is not None else []
    for n in nodes:
        if not (isinstance(n, torch.fx.Node) and n.op == "get_attr"):
            raise PassError(f"{module_of(attention)}: a per-head attention term that is not a constant; "
                            "cannot split its heads")
        keep(gm, n, q_heads, 0)
    return nodes


__all__ = ["ShardTensorParallel"]
