"""``devin::grouped_linear``: one GEMM per expert over expert-sorted rows, on prepacked weights.

Schema::

    devin::grouped_linear(Tensor x, Tensor offs, Tensor[] weights, int out_features) -> Tensor

x [S, K]: rows sorted by expert; offs [E] (int): cumulative row counts (expert e owns rows
``offs[e-1]:offs[e]``, rows past ``offs[-1]`` belong to none and come out 0); weights: E
oneDNN-prepacked [N, K] expert weights (:func:`.onednn_linear.prepack_weight`). Returns [S, N] =
``x[rows_e] @ W_eᵀ`` per expert, the same as transformers' ``grouped_mm_fallback(x, W.mT, offs)``
(HF's MoE experts under export on CPU), which calls ``mm`` on a transposed view of each expert.
One host read of ``offs`` per call (HF's fallback does the same); experts with no rows are skipped.
"""
from __future__ import annotations

import torch

from .onednn_linear import onednn_linear

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("grouped_linear(Tensor x, Tensor offs, Tensor[] weights, int out_features) -> Tensor")


def grouped_linear(x: torch.Tensor, offs: torch.Tensor, weights: list[torch.Tensor], out_features: int) -> torch.Tensor:
    if len(weights) != offs.numel():
        raise ValueError(f"devin::grouped_linear: {len(weights)} expert weights but {offs.numel()} offsets")
    out = x.new_zeros((x.shape[0], out_features))
    start = 0
    for w, end in zip(weights, offs.tolist()):
        if end > start:
            out[start:end] = onednn_linear(x[start:end], w)
        start = end
    return out


_lib.impl("grouped_linear", grouped_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::grouped_linear", lib=_lib)
def _(x, offs, weights, out_features):
    return x.new_empty((x.shape[0], out_features))
