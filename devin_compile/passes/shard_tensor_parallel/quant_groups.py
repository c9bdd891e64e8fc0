"""shard_tensor_parallel with a quantized model: row-parallel cuts must fall on INT4 group boundaries.

A row-parallel linear (output projection, down projection) keeps a run of input columns; its INT4
codes carry one scale and minimum per group of ``g`` columns (``backends.int4.format``), so a rank
can only keep whole groups: the run must start on a multiple of ``g`` and end on one, or at K (a
short last group stays the last rank's). Column-parallel cuts (output rows, vocabulary rows) and
FP8 (one scale a row) need nothing. Checked for every cut while planning, before any weight is
split; a cut off a boundary is a :class:`PassError` naming the layer, the group size and the way out.
"""
from __future__ import annotations

import torch
import torch.fx

from ...config.tensor_parallel import TensorParallelSpec
from ...graph_utils import hf_name
from ...pipeline import PassError
from .plan import module_of


def check_group_boundaries(rows: list[tuple[torch.fx.Node, range, int]], groups: dict[str, int] | None,
                           spec: TensorParallelSpec) -> None:
    """``rows``: (row-parallel linear, this rank's input columns, K) per cut; ``groups``: the quantized
    linears' INT4 group sizes by HF module name (None: no quantized model). A :class:`PassError`
    for the first cut whose columns do not hold whole groups."""
    if not groups:
        return
    for linear, cols, k in rows:
        weight = linear.args[1]
        name = hf_name(weight.target) if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" else None
        g = groups.get(name)
        if g is None or whole_groups(cols, k, g):
            continue
        raise PassError(
            f"{module_of(linear)}: tensor_parallel={spec.world_size} gives rank {spec.rank} its input features "
            f"[{cols.start}, {cols.stop}) of {k}, which do not fall on the INT4 group boundaries of {name} "
            f"(group size {g}): a rank can only keep whole groups of a row-parallel linear. Quantize with a "
            f"group size that divides {k // spec.world_size} (quantization={{..., 'group_size': G}}) or use "
            "tensor_parallel=1")


def whole_groups(cols: range, k: int, g: int) -> bool:
    """Whether columns ``cols`` of a K-wide weight are whole groups of ``g`` (the last one may end at K)."""
    return cols.start % g == 0 and (cols.stop % g == 0 or cols.stop == k)
