"""compile_decode (CPU): the decode graph → one ahead-compiled Inductor callable per bucket.

Pattern → replacement::

    Program.graphs["decode"] (FX, one Python dispatch per op)
        →  Program.decode_callables = {bucket: compiled}  (Inductor C++ kernels, one call)

The decode graph is compiled by Inductor with freezing (weights are constants it
pre-packs for oneDNN, like ``prepack_linear`` does for the eager graphs), a C++ wrapper
(no Python between the kernels: :data:`DEFAULTS`) and a symbolic token dimension, then run once per decode bucket on a scratch KV cache, so
every compile happens here, in ``optimize()``, not in the first steps of serving. At
run time the runner pads a decode batch up to its bucket (dummy tokens write to slot
-1, i.e. nowhere) and calls that bucket's callable; batches above the largest bucket
run the uncompiled decode graph. ``devin::`` ops stay opaque calls inside the compiled
code, and read their block tables and sequence lengths from the per-step context as
before, so the compiled code holds no runtime state.

Why one symbolic compile and not one static compile per bucket: on this CPU a compile of
SmolLM2's decode graph takes ~50 s (bench/results/decode.json), so eight static ones would cost minutes; with the
token dimension symbolic, batch 1 and batch >= 2 are the only two compiles (Inductor
specialises size 1), and every bucket reuses them. This is the CPU counterpart of
``wrap_cuda_graphs`` (CUDA Graphs per bucket on GPU); the runtime's ``DecodeGraphs`` runs both.

It is the one pass the compile cache does not store (``cached = False``): optimize() runs it after the
cached program is read back (or built), with Inductor's own caches under the compile cache's root.

Invariant: for every bucket, the compiled callable returns the decode graph's logits
(greedy tokens identical in float32; tested).
"""
from __future__ import annotations

import operator
import time

import torch

from ..graph_utils import copy_graph, fake_value
from ..pipeline import Pass, PassContext, PassError, PassResult, Program
from ..step import reachable_buckets


# Inductor options unless compile_decode_options says otherwise. freezing: weights become constants that
# Inductor pre-packs for oneDNN. cpp_wrapper: a C++ wrapper, not Python, calls the kernels and the opaque
# devin:: ops (SmolLM2 bf16 on a 2-core Intel AMX Xeon, b1 / 64 rows: eager 45.9 / 1327 tok/s, Python
# wrapper 48.2 / 1541, C++ wrapper 56.0 / 1730; compile 57 -> 70 s).
DEFAULTS = {"freezing": True, "cpp_wrapper": True}


class CompileDecode(Pass):
    name = "compile_decode"
    requires = ("split_phases",)
    runs_graphs = True  # torch.compile traces the decode graph's code
    cached = False  # its callables live in this process (Inductor's own caches hold their code on disk)

    def __init__(self, decode_buckets: tuple[int, ...], max_num_seqs: int, options: dict | None = None) -> None:
        super().__init__()
        # Inductor config: DEFAULTS, then the user's overrides (config.compile_decode_options)
        self.options = {**DEFAULTS, **(options or {})}
        # buckets the scheduler can reach (max_num_seqs caps a decode batch), plus the first above it
        self.buckets = reachable_buckets(decode_buckets, max_num_seqs)

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if ctx.info.device.type != "cpu":
            return f"CPU only; on {ctx.info.device.type} decode steps are CUDA Graphs (wrap_cuda_graphs)"
        if "decode" not in program.graphs:
            return "no decode graph (split_phases is off)"
        return None

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        if ctx.scratch_step is None:
            raise PassError("compile_decode runs the decode graph to compile it, and needs a scratch KV cache: "
                            "build its PassContext with scratch_step= (optimize() does)")
        gm = _for_inductor(program.graphs["decode"])
        t0 = time.perf_counter()
        with torch._inductor.config.patch(self.options):
            compiled = torch.compile(gm, dynamic=True, fullgraph=True)
            try:
                for b in self.buckets:
                    _warm(compiled, ctx, b)
            except Exception as e:  # noqa: BLE001  (report which compile failed, with the cause)
                raise PassError(f"compile_decode: Inductor could not compile the decode graph "
                                f"({type(e).__name__}: {e}); run optimize(..., compile_decode=False)") from e
        program.decode_callables = {b: compiled for b in self.buckets}
        dt = time.perf_counter() - t0
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return PassResult(matches=len(self.buckets),
                          note=f"Inductor ({opts}, symbolic batch) for buckets {list(self.buckets)}; "
                               f"compiled and warmed in {dt:.1f} s")


def _for_inductor(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` (same parameters) with ``devin::rms_norm`` back as ``aten.rms_norm`` and
    ``devin::rotary_heads`` / ``devin::silu_mul`` / ``devin::add_rms_norm`` as their Python kernels (plain torch code that
    Dynamo inlines), which Inductor fuses with their neighbours; the eager graph keeps the ops'
    C++ kernels."""
    from ..ops.rms_norm import add_rms_norm
    from ..ops.rotary_heads import rotary_heads
    from ..ops.silu_mul import silu_mul

    inline = {torch.ops.devin.rotary_heads.default: rotary_heads, torch.ops.devin.silu_mul.default: silu_mul,
              torch.ops.devin.add_rms_norm.default: add_rms_norm}
    graph = copy_graph(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.devin.rms_norm.default:
            x, w, eps = node.args
            node.target = torch.ops.aten.rms_norm.default
            node.args = (x, [_hidden_size(gm, x, w)], w, eps)
        elif node.op == "call_function" and node.target in inline:
            node.target = inline[node.target]
    return torch.fx.GraphModule(gm, graph)


def _hidden_size(gm: torch.fx.GraphModule, x: torch.fx.Node, weight) -> int:
    """The size ``rms_norm`` normalises over: ``x``'s last dimension, from its fake value or, in a graph read
    back from the compile cache (no node metadata), from the norm's weight."""
    val = fake_value(x)
    if val is not None:
        return val.shape[-1]
    if isinstance(weight, torch.fx.Node) and weight.op == "get_attr":
        return operator.attrgetter(weight.target)(gm).shape[-1]
    raise PassError(f"compile_decode: the size {x.name}'s rms_norm normalises over is unknown (no shape "
                    "metadata, no weight); run optimize(..., compile_decode=False)")


def _warm(fn, ctx: PassContext, batch: int) -> None:
    """Run ``fn`` once at ``batch`` decode tokens (one token of each of ``batch`` sequences) on a
    scratch cache (compiles on first sight)."""
    dev = ctx.info.device
    ids = torch.zeros((1, batch), dtype=torch.long, device=dev)
    pos = torch.zeros((1, batch), dtype=torch.long, device=dev)
    idx = torch.arange(batch, device=dev)
    with torch.inference_mode(), ctx.scratch_step([1] * batch):
        fn(ids, pos, idx)
