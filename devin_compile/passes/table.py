"""The pass table: every pass of ``optimize()``'s pipeline, in order, with when it runs.

One row per pass (AutoDeploy/vLLM style): its class (which gives the name and ``requires``),
its stage, what enables it, which passes it must follow when they run too (``after``) and how
it is built from the typed inputs. The pipeline for a config is the table's enabled rows, in
table order. :func:`check_table` checks the table itself (each row's ``requires`` and ``after``
stand above it, stages in order); :class:`~devin_compile.pipeline.PassManager` then checks
that every pass's prerequisites run before it.

``enabled_by`` is None (always), :class:`Flags` (pass options of ``config.passes``, all of
which must be true) or a :class:`When` predicate over the :class:`PipelineInputs` (for inputs
that are not pass options: a quantized model, offloaded roles, ``kv_prune=``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..config import OptimizeConfig, PassOptions
from ..config.tensor_parallel import TensorParallelSpec
from ..pipeline import Pass
from ..quant.config import QuantConfig
from ..quant.result import QuantResult
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
from .upcast_linear import UpcastLinear
from .wrap_cuda_graphs import WrapCudaGraphs

#: Stages in pipeline order; a row's stage is never earlier than the row before it.
STAGES = ("lower", "fuse", "precision", "phases", "placement", "linear_kernels", "cleanup", "late_fuse", "compile")


@dataclass(frozen=True)
class PipelineInputs:
    """What decides and builds the pipeline: the typed config and what ``optimize()`` resolved
    from the model before capture (validated ``offload_layers`` roles; the quantized weights)."""

    config: OptimizeConfig
    offload_roles: frozenset[str] = frozenset()
    quant: tuple[QuantResult, QuantConfig] | None = None
    tensor_parallel: TensorParallelSpec | None = None  # this rank's place in the group (tensor_parallel > 1)


class _OptionReads:
    """Stands in for :class:`PassOptions` to learn which fields a :class:`Flags` test reads."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __getattr__(self, name: str) -> bool:
        if name not in _PASS_OPTIONS:
            raise AttributeError(f"PassOptions has no field {name!r} (fields: {sorted(_PASS_OPTIONS)})")
        self.read.append(name)
        return True


_PASS_OPTIONS = {f.name for f in dataclasses.fields(PassOptions)}


@dataclass(frozen=True)
class Flags:
    """Enabled when the pass options ``test`` reads are all true, e.g.
    ``Flags(lambda o: o.fuse_projections and o.fuse_silu_mul)`` over ``config.passes``."""

    test: Callable[[PassOptions], bool]

    def __call__(self, inputs: PipelineInputs) -> bool:
        return bool(self.test(inputs.config.passes))

    @property
    def names(self) -> tuple[str, ...]:
        """The option fields the test reads (an unknown field is an ``AttributeError``)."""
        reads = _OptionReads()
        self.test(reads)  # type: ignore[arg-type]
        return tuple(reads.read)

    @property
    def text(self) -> str:
        return " and ".join(f"{name}=True" for name in self.names)


@dataclass(frozen=True)
class When:
    """A predicate over the pipeline inputs, with the words the docs and errors show for it."""

    test: Callable[[PipelineInputs], bool]
    text: str

    def __call__(self, inputs: PipelineInputs) -> bool:
        return self.test(inputs)


@dataclass(frozen=True)
class PassSpec:
    """One row of the table (see the module docstring)."""

    pass_cls: type[Pass]
    stage: str
    enabled_by: Flags | When | None = None
    after: tuple[str, ...] = ()  # passes that must run before this one when they run too
    build: Callable[[PipelineInputs], Pass] | None = None  # None: ``pass_cls()``

    @property
    def name(self) -> str:
        return self.pass_cls.name

    @property
    def requires(self) -> tuple[str, ...]:
        return self.pass_cls.requires

    def enabled(self, inputs: PipelineInputs) -> bool:
        return self.enabled_by is None or self.enabled_by(inputs)

    def describe_enabled_by(self) -> str:
        return "always" if self.enabled_by is None else self.enabled_by.text

    def make(self, inputs: PipelineInputs) -> Pass:
        return self.build(inputs) if self.build is not None else self.pass_cls()


def _int4_groups(quant: tuple[QuantResult, QuantConfig] | None) -> dict[str, int] | None:
    """A quantized model's INT4 group size per linear (HF name), which shard_tensor_parallel's row cuts must keep whole."""
    return None if quant is None else {name: ql.group_size for name, ql in quant[0].linears.items()}


PASS_TABLE: tuple[PassSpec, ...] = (
    PassSpec(AttentionToPaged, "lower"),
    PassSpec(ShardTensorParallel, "lower", When(lambda i: i.tensor_parallel is not None, "tensor_parallel > 1"),
             build=lambda i: ShardTensorParallel(i.tensor_parallel, _int4_groups(i.quant))),
    PassSpec(FuseRMSNorm, "fuse", Flags(lambda o: o.fuse_rms_norm)),
    PassSpec(FuseRotary, "fuse", Flags(lambda o: o.fuse_rotary)),
    PassSpec(FuseProjections, "fuse", Flags(lambda o: o.fuse_projections)),
    PassSpec(FuseSiluMul, "fuse", Flags(lambda o: o.fuse_projections and o.fuse_silu_mul), after=("fuse_projections",)),
    PassSpec(AssignPrecision, "precision", When(lambda i: i.quant is not None, "quantization= or quantized="),
             build=lambda i: AssignPrecision(*i.quant)),
    PassSpec(SplitPhases, "phases", Flags(lambda o: o.split_phases),
             build=lambda i: SplitPhases(i.config.decode_buckets)),
    PassSpec(InsertKVPrune, "phases", When(lambda i: i.config.kv_prune is not None, "kv_prune=")),
    PassSpec(OffloadEmbeddings, "placement", When(lambda i: bool(i.offload_roles), "offload_layers="),
             build=lambda i: OffloadEmbeddings(set(i.offload_roles))),
    PassSpec(PackGemmLinears, "linear_kernels", Flags(lambda o: o.pack_linears), after=("assign_precision",)),
    PassSpec(PrepackOneDNNLinears, "linear_kernels", Flags(lambda o: o.prepack_linear),
             after=("assign_precision", "pack_gemm_linears")),
    PassSpec(FuseMoEExperts, "linear_kernels", Flags(lambda o: o.fuse_moe_experts)),
    PassSpec(PrepackOneDNNExperts, "linear_kernels", Flags(lambda o: o.prepack_linear), after=("fuse_moe_experts",)),
    PassSpec(UpcastLinear, "linear_kernels", Flags(lambda o: o.upcast_linear), after=("assign_precision",)),
    PassSpec(Cleanup, "cleanup"),
    PassSpec(FuseAttentionInputs, "late_fuse", Flags(lambda o: o.fuse_rotary and o.fuse_attention_inputs)),
    PassSpec(FuseAddRMSNorm, "late_fuse", Flags(lambda o: o.fuse_rms_norm and o.fuse_add_rms_norm),
             after=("assign_precision", "cleanup")),
    PassSpec(CompileDecode, "compile", When(lambda i: i.config.compile_decode, "compile_decode=True"),
             after=("cleanup", "fuse_attention_inputs"),
             build=lambda i: CompileDecode(i.config.decode_buckets, i.config.scheduler.max_num_seqs,
                                           i.config.compile_decode_options)),
    PassSpec(WrapCudaGraphs, "compile", Flags(lambda o: o.split_phases and o.cuda_graphs), after=("cleanup", "fuse_attention_inputs"),
             build=lambda i: WrapCudaGraphs(max_decode_rows(i.config))),
)


def max_decode_rows(config: OptimizeConfig) -> int:
    """The most rows a decode step can have: ``max_num_seqs`` sequences, or with speculative decoding
    up to ``max_verify_tokens`` verify rows."""
    rows = config.scheduler.max_num_seqs
    if config.speculative is not None:
        rows = max(rows, config.speculative.max_verify_tokens)
    return rows


def check_table(table: tuple[PassSpec, ...]) -> None:
    """A ``ValueError`` unless names are unique, stages in :data:`STAGES` order, every ``requires`` and
    ``after`` of a row names a row above it, and every :class:`Flags` reads existing pass options."""
    above: set[str] = set()
    last = 0
    for spec in table:
        if spec.stage not in STAGES:
            raise ValueError(f"pass table: {spec.name!r} has stage {spec.stage!r}; stages: {list(STAGES)}")
        if STAGES.index(spec.stage) < last:
            raise ValueError(f"pass table: {spec.name!r} (stage {spec.stage!r}) comes after a later stage")
        for before in (*spec.requires, *spec.after):
            if before not in above:
                raise ValueError(f"pass table: {spec.name!r} must run after {before!r}, which is not a row above it")
        if spec.name in above:
            raise ValueError(f"pass table: {spec.name!r} has two rows")
        spec.describe_enabled_by()  # a Flags test reading an unknown option fails here
        above.add(spec.name)
        last = STAGES.index(spec.stage)


check_table(PASS_TABLE)


def build_passes(inputs: PipelineInputs, table: tuple[PassSpec, ...] = PASS_TABLE) -> list[Pass]:
    """The enabled rows of ``table`` for ``inputs``, built, in table order."""
    if table is not PASS_TABLE:
        check_table(table)
    return [spec.make(inputs) for spec in table if spec.enabled(inputs)]


def table_markdown(table: tuple[PassSpec, ...] = PASS_TABLE) -> str:
    """The table as markdown (pass, stage, enabled by, requires, after), for docs and ``--help`` text."""
    lines = ["| # | pass | stage | enabled by | requires | after |", "|---|---|---|---|---|---|"]
    for i, spec in enumerate(table, start=1):
        lines.append(f"| {i:02d} | {spec.name} | {spec.stage} | {spec.describe_enabled_by()} | "
                     f"{', '.join(spec.requires) or '-'} | {', '.join(spec.after) or '-'} |")
    return "\n".join(lines)
