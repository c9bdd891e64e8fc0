"""Which optional passes ``optimize()`` runs: one flag per pass (or pair of passes), all on by default.

Users pass them flat (``optimize(fuse_rms_norm=False)``, ``--option pack_linears=false``);
:meth:`~.optimize.OptimizeConfig.from_kwargs` files them here, and the pass table
(``passes/table.py``) reads them as fields of ``config.passes``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..validation import flag


@dataclass
class PassOptions:
    """One flag per optional pass; the pass table says which pass each one enables."""

    fuse_rms_norm: bool = True
    fuse_rotary: bool = True
    fuse_attention_inputs: bool = True
    fuse_projections: bool = True
    fuse_silu_mul: bool = True
    # CPU: a residual add and the RMSNorm after it → one devin::add_rms_norm (needs fuse_rms_norm).
    fuse_add_rms_norm: bool = True
    # CPU: linears (prepack_onednn_linears) and MoE expert GEMMs (prepack_onednn_experts) on oneDNN
    # over weights prepacked once.
    prepack_linear: bool = True
    # CPU float32: linears → devin::packed_gemm_linear (pack_gemm_linears: the logits linear; all of them
    # with AVX-512).
    pack_linears: bool = True
    # CPU float32: HF's routed MoE experts → one devin::moe_experts (each selected expert read once a step).
    fuse_moe_experts: bool = True
    # CPU bf16/fp16 without native oneDNN kernels: linears of 8+ rows computed in float32.
    upcast_linear: bool = True
    split_phases: bool = True
    # CUDA: decode steps replayed as CUDA Graphs, one per reachable decode bucket (wrap_cuda_graphs).
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        flag("split_phases", self.split_phases)
