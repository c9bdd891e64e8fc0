"""Graph passes, one per module, each ``graph → graph`` (see pipeline.Pass); their order and
conditions are the pass table (:mod:`.table`). A pass imports no other pass: what passes share
lives in :mod:`devin_compile.graph_utils` (FX helpers), :mod:`devin_compile.ops` (kernels) and
:mod:`devin_compile.pipeline` (the context: shared weights, outputs)."""
from __future__ import annotations

from collections.abc import Set

from ..config import OptimizeConfig
from ..config.tensor_parallel import TensorParallelSpec
from ..pipeline import Pass
from .assign_precision import AssignPrecision
from .attention_to_paged import AttentionToPaged
from .cleanup import Cleanup
from .compile_decode import CompileDecode
from .fuse_add_rms_norm import FuseAddRMSNorm
from .fuse_attention_inputs import FuseAttentionInputs
from .fuse_moe_experts import FuseMoEExperts
from .fuse_projections import FuseProjections
from .fuse_rms_norm import FuseRMSNorm
from .fuse_rotary import FuseRotary
from .fuse_silu_mul import FuseSiluMul
from .insert_kv_prune import InsertKVPrune
from .offload_embeddings import OffloadEmbeddings
from .pack_gemm_linears import PackGemmLinears
from .prepack_onednn_experts import PrepackOneDNNExperts
from .prepack_onednn_linears import PrepackOneDNNLinears
from .shard_tensor_parallel import ShardTensorParallel
from .split_phases import SplitPhases
from .table import PASS_TABLE, Flags, PassSpec, PipelineInputs, When, build_passes
from .upcast_linear import UpcastLinear
from .wrap_cuda_graphs import WrapCudaGraphs


def default_passes(config: OptimizeConfig, offload_roles: Set[str] = frozenset(), quant=None,
                   tensor_parallel: TensorParallelSpec | None = None) -> list[Pass]:
    """The optimize() pipeline, in order: the enabled rows of :data:`~.table.PASS_TABLE`.
    ``offload_roles``: validated ``offload_layers`` roles; ``quant``: (QuantResult, QuantConfig)
    to add assign_precision; ``tensor_parallel``: this rank's place, to add shard_tensor_parallel."""
    return build_passes(PipelineInputs(config, frozenset(offload_roles), quant, tensor_parallel))


__all__ = ["AssignPrecision", "AttentionToPaged", "Cleanup", "CompileDecode", "FuseAddRMSNorm", "FuseAttentionInputs", "FuseMoEExperts",
           "FuseProjections", "FuseRMSNorm", "FuseRotary", "FuseSiluMul", "InsertKVPrune", "OffloadEmbeddings",
           "PackGemmLinears", "PrepackOneDNNExperts", "PrepackOneDNNLinears", "ShardTensorParallel", "SplitPhases", "UpcastLinear",
           "WrapCudaGraphs",           "PASS_TABLE", "Flags", "PassSpec", "PipelineInputs", "When", "build_passes", "default_passes"]
