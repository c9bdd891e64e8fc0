"""The pass table: every pass of ``optimize()``'s pipeline, in order, with when it runs.

One row per pass (AutoDeploy/vLLM style): its class (which gives the name and ``requires``),
its stage, what enables it and how it is built from the typed inputs. The pipeline for a
config is the table's enabled rows, in table order; :class:`~devin_compile.pipeline.PassManager`
then checks that every pass's prerequisites run before it.

``enabled_by`` is either a tuple of :class:`~devin_compile.config.OptimizeConfig` flags, all of
which must be true (``()``: always), or a :class:`When` predicate over the
:class:`PipelineInputs` (for inputs that are not flags: a quantized model, offloaded roles).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import OptimizeConfig
from ..pipeline import Pass
from ..quant.config import QuantConfig
from ..quant.result import QuantResult
from .assign_precision import AssignPrecision
from .attention_to_paged import AttentionToPaged
from .cleanup import Cleanup
from .compile_decode import CompileDecode
from .fuse_attention_inputs import FuseAttentionInputs
from .fuse_moe_experts import FuseMoEExperts
from .fuse_projections import FuseProjections
from .fuse_rms_norm import FuseRMSNorm
from .fuse_rotary import FuseRotary
from .fuse_silu_mul import FuseSiluMul
from .insert_kv_prune import InsertKVPrune
from .offload_embeddings import OffloadEmbeddings
from .pack_linears import PackLinears
from .prepack_experts import PrepackExperts
from .prepack_linear import PrepackLinear
from .split_phases import SplitPhases
from .upcast_linear import UpcastLinear

#: Stages in pipeline order; a row's stage is never earlier than the row before it.
STAGES = ("lower", "fuse", "precision", "phases", "placement", "linear_kernels", "cleanup", "late_fuse", "compile")


@dataclass(frozen=True)
class PipelineInputs:
    """What decides and builds the pipeline: the typed config and what ``optimize()`` resolved
    from the model before capture (validated ``offload_layers`` roles; the quantized weights)."""

    config: OptimizeConfig
    offload_roles: frozenset[str] = frozenset()
    quant: tuple[QuantResult, QuantConfig] | None = None


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
    enabled_by: tuple[str, ...] | When = ()
    build: Callable[[PipelineInputs], Pass] | None = None  # None: ``pass_cls()``

    @property
    def name(self) -> str:
        return self.pass_cls.name

    @property
    def requires(self) -> tuple[str, ...]:
        return self.pass_cls.requires

    def enabled(self, inputs: PipelineInputs) -> bool:
        if isinstance(self.enabled_by, When):
            return self.enabled_by(inputs)
        return all(getattr(inputs.config, flag) for flag in self.enabled_by)

    def describe_enabled_by(self) -> str:
        if isinstance(self.enabled_by, When):
            return self.enabled_by.text
        return " and ".join(f"{flag}=True" for flag in self.enabled_by) or "always"

    def make(self, inputs: PipelineInputs) -> Pass:
        return self.build(inputs) if self.build is not None else self.pass_cls()


PASS_TABLE: tuple[PassSpec, ...] = (
    PassSpec(AttentionToPaged, "lower"),
    PassSpec(FuseRMSNorm, "fuse", ("fuse_rms_norm",)),
    PassSpec(FuseRotary, "fuse", ("fuse_rotary",)),
    PassSpec(FuseProjections, "fuse", ("fuse_projections",)),
    # matches the split of fuse_projections' fused gate/up
    PassSpec(FuseSiluMul, "fuse", ("fuse_projections", "fuse_silu_mul")),
    PassSpec(AssignPrecision, "precision", When(lambda i: i.quant is not None, "quantization= or quantized="),
             build=lambda i: AssignPrecision(*i.quant)),
    PassSpec(SplitPhases, "phases", ("split_phases",), build=lambda i: SplitPhases(i.config.decode_buckets)),
    PassSpec(InsertKVPrune, "phases", When(lambda i: i.config.kv_prune is not None, "kv_prune=")),
    PassSpec(OffloadEmbeddings, "placement", When(lambda i: bool(i.offload_roles), "offload_layers="),
             build=lambda i: OffloadEmbeddings(set(i.offload_roles))),
    PassSpec(PackLinears, "linear_kernels", ("pack_linears",)),  # before prepack_linear takes the rest
    PassSpec(PrepackLinear, "linear_kernels", ("prepack_linear",)),
    # before prepack_experts: the expert blocks it fuses leave no grouped GEMMs to prepack
    PassSpec(FuseMoEExperts, "linear_kernels", ("fuse_moe_experts",)),
    PassSpec(PrepackExperts, "linear_kernels", ("prepack_linear",)),  # MoE experts are linears too
    PassSpec(UpcastLinear, "linear_kernels", ("upcast_linear",)),
    PassSpec(Cleanup, "cleanup"),
    # fuse_rotary's roll form, after cleanup's CSE has left one cos and one sin per step
    PassSpec(FuseAttentionInputs, "late_fuse", ("fuse_rotary", "fuse_attention_inputs")),
    PassSpec(CompileDecode, "compile", ("compile_decode",),
             build=lambda i: CompileDecode(i.config.decode_buckets, i.config.scheduler.max_num_seqs,
                                           i.config.compile_decode_options)),
)


def build_passes(inputs: PipelineInputs, table: tuple[PassSpec, ...] = PASS_TABLE) -> list[Pass]:
    """The enabled rows of ``table`` for ``inputs``, built, in table order."""
    return [spec.make(inputs) for spec in table if spec.enabled(inputs)]


def table_markdown(table: tuple[PassSpec, ...] = PASS_TABLE) -> str:
    """The table as markdown (pass, stage, enabled by, requires), for docs and ``--help`` text."""
    lines = ["| # | pass | stage | enabled by | requires |", "|---|---|---|---|---|"]
    for i, spec in enumerate(table, start=1):
        lines.append(f"| {i:02d} | {spec.name} | {spec.stage} | {spec.describe_enabled_by()} | "
                     f"{', '.join(spec.requires) or '-'} |")
    return "\n".join(lines)
