"""Graph passes, one per file, each ``graph → graph`` (see pipeline.Pass)."""
from __future__ import annotations

from .assign_precision import AssignPrecision
from .attention_to_paged import AttentionToPaged
from .cleanup import Cleanup
from .fuse_projections import FuseProjections
from .fuse_rms_norm import FuseRMSNorm
from .fuse_rotary import FuseRotary
from .prepack_linear import PrepackLinear
from .split_phases import SplitPhases


def default_passes(config, info, quant=None) -> list:
    """The optimize() pipeline, in order. ``quant``: (QuantResult, QuantConfig) to add assign_precision."""
    passes = [AttentionToPaged()]
    if config.fuse_rms_norm:
        passes.append(FuseRMSNorm())
    if config.fuse_rotary:
        passes.append(FuseRotary())
    if config.fuse_projections:
        passes.append(FuseProjections())
    if quant is not None:
        passes.append(AssignPrecision(*quant))
    if config.prepack_linear:
        passes.append(PrepackLinear())
    if config.split_phases:
        passes.append(SplitPhases(config.decode_buckets))
    passes.append(Cleanup())
    return passes


__all__ = ["AssignPrecision", "AttentionToPaged", "Cleanup", "FuseProjections", "FuseRMSNorm", "FuseRotary", "PrepackLinear", "SplitPhases", "default_passes"]
