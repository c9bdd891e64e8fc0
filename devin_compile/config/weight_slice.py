"""Which part of a full weight a tensor-parallel rank keeps: :class:`WeightSlice`.

``shard_tensor_parallel`` records one on every ``get_attr`` whose tensor it cuts
(``node.meta["tp_slice"]``; ``fuse_projections`` carries them onto the fused linear as
``meta["fused_slices"]``), and ``assign_precision`` cuts the quantized tensors of that linear
(INT4 codes and group scales, FP8 codes and row scales, AWQ scales, the INT8 head) the same way,
so a rank quantizes nothing itself: every rank holds the full quantization's slice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightSlice:
    """Entries ``ranges`` (one after another) of a tensor's ``size`` along ``dim``, followed by zero
    entries up to ``padded_to`` (a vocabulary shard of ⌈V/N⌉ rows; None: no padding)."""

    dim: int
    ranges: tuple[range, ...]
    size: int
    padded_to: int | None = None

    @property
    def length(self) -> int:
        """Entries along ``dim`` after the cut (padding included)."""
        return self.padded_to if self.padded_to is not None else sum(len(r) for r in self.ranges)

    def take(self, t: torch.Tensor, dim: int | None = None, fill: float = 0) -> torch.Tensor:
        """The kept entries of ``t`` (full along ``dim``, default :attr:`dim`), padded with ``fill``; a copy."""
        d = self.dim if dim is None else dim
        if t.shape[d] != self.size:
            raise ValueError(f"a tensor of shape {tuple(t.shape)} has {t.shape[d]} entries along dim {d}, but the "
                             f"rank's slice was cut from {self.size}")
        kept = torch.cat([t.narrow(d, r.start, len(r)) for r in self.ranges], d)
        if self.padded_to is not None and self.padded_to > kept.shape[d]:
            shape = list(kept.shape)
            shape[d] = self.padded_to - kept.shape[d]
            kept = torch.cat([kept, kept.new_full(shape, fill)], d)
        return kept.contiguous().clone()
