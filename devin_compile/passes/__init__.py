"""Graph passes, one per file, each ``graph → graph`` (see pipeline.Pass)."""
from __future__ import annotations

from .assign_precision import AssignPrecision
from .attention_to_paged import AttentionToPaged
from .cleanup import Cleanup
from .compile_decode import CompileDecode
from .fuse_attention_inputs import FuseAttentionInputs
from .fuse_projections import FuseProjections
from .fuse_rms_norm import FuseRMSNorm
from .fuse_rotary import FuseRotary
from .fuse_silu_mul import FuseSiluMul
from .insert_kv_prune import InsertKVPrune
from .offload_embeddings import OffloadEmbeddings
from .prepack_linear import PrepackLinear
from .split_phases import SplitPhases
from .upcast_linear import UpcastLinear


def default_passes(config, info, offload_roles: set[str] = frozenset(), quant=None) -> list:
    """The optimize() pipeline, in order. ``offload_roles``: validated ``offload_layers`` roles;
    ``quant``: (QuantResult, QuantConfig) to add assign_precision."""
    passes = [AttentionToPaged()]
    if config.fuse_rms_norm:
        passes.append(FuseRMSNorm())
    if config.fuse_rotary:
        passes.append(FuseRotary())
    if config.fuse_projections:
        passes.append(FuseProjections())
        if config.fuse_silu_mul:  # matches the fused gate/up's split
            passes.append(FuseSiluMul())
    if quant is not None:
        passes.append(AssignPrecision(*quant))
    if config.split_phases:
        passes.append(SplitPhases(config.decode_buckets))
    if getattr(config, "kv_prune", None) is not None:
        passes.append(InsertKVPrune())
    if offload_roles:
        passes.append(OffloadEmbeddings(offload_roles))
    if config.prepack_linear:
        passes.append(PrepackLinear())
    if config.upcast_linear:
        passes.append(UpcastLinear())
    passes.append(Cleanup())
    if config.fuse_rotary and config.fuse_attention_inputs:  # fuse_rotary's roll form, after cleanup's CSE
        passes.append(FuseAttentionInputs())
    if config.compile_decode:
        passes.append(CompileDecode(config.decode_buckets, config.scheduler.max_num_seqs,
                                    getattr(config, "compile_decode_options", None)))
    return passes


__all__ = ["AssignPrecision", "AttentionToPaged", "Cleanup", "CompileDecode", "FuseAttentionInputs", "FuseProjections", "FuseRMSNorm", "FuseRotary", "FuseSiluMul",
           "InsertKVPrune", "OffloadEmbeddings", "PrepackLinear", "SplitPhases", "UpcastLinear",
           "default_passes"]
