"""Pass base class and PassManager: order, verify, report, dump.

A :class:`Program` is a set of named FX graphs (``main`` after capture; ``prefill`` and
``decode`` once phases are split). A :class:`Pass` rewrites a Program in place and
returns a :class:`PassResult`; it never holds runtime state. The manager

1. validates the order: each pass's ``requires`` (a cycle, or a prerequisite that is missing or
   scheduled later, is a ``ValueError``; the pass table also checks its rows' ``after``);
2. runs each pass, lints every graph after it, and records time, matches and node counts;
   graphs are recompiled (Python code regenerated, ~50 ms per graph here) only where code
   runs: before a pass that sets ``runs_graphs``, before a probe, and once at the end;
3. dumps ``NN_<pass>.py`` (readable code), ``NN_<pass>.txt`` (nodes with shape:dtype)
   and ``index.md`` (the report table) when a dump directory is set;
4. with ``verify=True``, re-runs a probe after each pass and names the first pass whose
   output drifts from the captured graph's.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Protocol, Sequence, TypeVar

import networkx as nx
import torch
import torch.fx

from .capture import ModelInfo
from .config import OptimizeConfig
from .graph_utils import count_nodes, describe_value
from .step import StepContext

T = TypeVar("T")
log = logging.getLogger(__name__)
#: A pass taking longer than this (seconds) gets its own progress line (INFO).
SLOW_PASS_S = 1.0


class PassError(RuntimeError):
    """A pass could not do a required rewrite (names the layer and pattern)."""


@dataclass
class Program:
    """The graphs being compiled, by phase name."""

    graphs: dict[str, torch.fx.GraphModule]
    # Decode batch sizes the decode graph is specialised for (set by split_phases).
    decode_buckets: tuple[int, ...] = ()
    # Static-shape decode callables by bucket (set by a pass that compiles or captures them);
    # when present, the runtime pads decode batches up to their bucket and calls these.
    decode_callables: dict[int, Callable] = field(default_factory=dict)
    # Buckets whose decode steps the runtime captures as CUDA Graphs (set by wrap_cuda_graphs,
    # which checked that every node of the decode graph is capture-safe).
    cuda_graph_buckets: tuple[int, ...] = ()

    def node_count(self) -> int:
        return sum(count_nodes(g) for g in self.graphs.values())

    def recompile(self) -> None:
        """Regenerate every graph's Python code from its (rewritten) nodes."""
        for gm in self.graphs.values():
            gm.recompile()

    @property
    def main(self) -> torch.fx.GraphModule:
        return next(iter(self.graphs.values()))


class ScratchStep(Protocol):
    """Runs graph code outside serving (a probe, a warm-up compile): ``with scratch_step([3, 1]):``
    installs a step context over a scratch paged KV cache for one step of fresh sequences
    with these numbers of tokens (each holds only its own tokens), and removes it after."""

    def __call__(self, query_lens: Sequence[int]) -> ContextManager[StepContext]: ...


class SharedWeights:
    """Copies of weights a pass makes once per program for every graph of it to read.

    The prefill and decode graphs share their weight tensors (``split_phases``), so a pass that
    replaces a weight by a packed copy makes the copy once and both graphs read it:
    ``ctx.shared_weights.get(self.name, (w,), lambda: prepack_weight(w))``. A copy is keyed
    by the pass's ``kind`` and the identity of its source tensors, which the graphs keep alive
    while the pass runs."""

    def __init__(self) -> None:
        self._copies: dict[tuple[str, tuple[int, ...]], Any] = {}

    def get(self, kind: str, sources: Sequence[torch.Tensor], make: Callable[[], T]) -> T:
        """The ``kind`` copy of ``sources``, made by ``make()`` the first time it is asked for."""
        key = (kind, tuple(id(t) for t in sources))
        if key not in self._copies:
            self._copies[key] = make()
        return self._copies[key]


@dataclass
class PassOutputs:
    """What passes hand back to whoever runs the pipeline (``optimize()`` reads it)."""

    # assign_precision: one row per quantized-model linear (precision, bits, group size, sensitivity,
    # bytes), and its report note.
    precision_table: list[dict[str, Any]] = field(default_factory=list)
    precision_note: str = ""


@dataclass
class PassContext:
    """What a pass may read besides the graphs; it holds no runtime state.

    ``info``: the captured model (None for Dynamo graphs in the torch.compile backend);
    ``config``: the typed options, where a pass reads the decisions of other passes (e.g.
    ``config.compile_decode``); ``scratch_step``: handed in by whoever runs the pipeline
    (``optimize()``: ``runtime.scratch``), for passes that run a graph, None where no runtime
    exists; ``shared_weights``: packed weight copies the graphs of the program share;
    ``outputs``: what passes leave for the caller (the precision table)."""

    info: ModelInfo | None
    config: OptimizeConfig = field(default_factory=OptimizeConfig)
    scratch_step: ScratchStep | None = None
    shared_weights: SharedWeights = field(default_factory=SharedWeights)
    outputs: PassOutputs = field(default_factory=PassOutputs)


@dataclass
class PassResult:
    matches: int = 0
    note: str = ""
    details: str = ""  # optional markdown (e.g. a per-layer table), printed after the report table


class Pass:
    """Base class. Subclasses set ``name`` and ``requires`` and implement :meth:`run_graph`
    (called per graph) or :meth:`run` (whole program)."""

    name: ClassVar[str] = "pass"
    requires: ClassVar[tuple[str, ...]] = ()
    # True when the pass executes or traces a graph's Python code (e.g. torch.compile on it):
    # the manager then recompiles the graphs before it. Rewrites of graph nodes need not.
    runs_graphs: ClassVar[bool] = False
    # Set (to the note the report shows) by a pass whose rewrite Inductor does its own way: with
    # ``config.compile_decode`` the decode graph is left to it, and ``run_graph`` never sees it.
    leaves_compiled_decode: ClassVar[str | None] = None
    # False for a pass whose output the compile cache cannot store (compiled callables): optimize() runs it
    # after the cached program is read back (or built), in a second PassManager (``ran_before=``).
    cached: ClassVar[bool] = True

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        """A one-line reason to skip this pass here (e.g. no CUDA), or None to run it."""
        return None

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        total = PassResult()
        notes = []
        for phase, gm in program.graphs.items():
            if phase == "decode" and self.leaves_compiled_decode and ctx.config.compile_decode:
                r = PassResult(note=self.leaves_compiled_decode)
            else:
                r = self.run_graph(gm, phase, ctx)
            total.matches += r.matches
            if r.note:
                notes.append(r.note if len(program.graphs) == 1 else f"{phase}: {r.note}")
            if r.details:
                total.details += r.details if len(program.graphs) == 1 else f"\n{phase}:\n\n{r.details}\n"
        total.note = "; ".join(notes)
        return total

    def run_graph(self, gm: torch.fx.GraphModule, phase: str, ctx: PassContext) -> PassResult:
        raise NotImplementedError(f"{type(self).__name__} implements neither run nor run_graph")


@dataclass
class PassRecord:
    index: int
    name: str
    status: str  # "ran" | "skipped"
    time_ms: float
    matches: int
    nodes_before: int
    nodes_after: int
    note: str = ""
    max_drift: float | None = None
    details: str = ""


@dataclass
class PassReport:
    records: list[PassRecord] = field(default_factory=list)
    first_drift: str | None = None

    def as_markdown(self) -> str:
        verify = any(r.max_drift is not None for r in self.records)
        head = "| # | pass | status | time ms | matches | nodes before | nodes after | note |"
        sep = "|---|---|---|---:|---:|---:|---:|---|"
        if verify:
            head += " max drift |"
            sep += "---:|"
        lines = [head, sep]
        for r in self.records:
            row = (f"| {r.index:02d} | {r.name} | {r.status} | {r.time_ms:.1f} | {r.matches} | "
                   f"{r.nodes_before} | {r.nodes_after} | {r.note} |")
            if verify:
                row += f" {'' if r.max_drift is None else f'{r.max_drift:.2e}'} |"
            lines.append(row)
        if self.first_drift:
            lines.append(f"\nFirst pass whose output drifts: **{self.first_drift}**")
        for r in self.records:
            if r.details:
                lines.append(f"\n#### {r.index:02d} {r.name}\n\n{r.details}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.as_markdown()


Probe = Callable[[Program], torch.Tensor]


class PassManager:
    """Runs an ordered list of passes over a Program (see module docstring)."""

    def __init__(self, passes: list[Pass], *, dump_dir: str | None = None, probe: Probe | None = None,
                 drift_tol: float = 1e-3, ran_before: Sequence[str] = ()) -> None:
        names = [p.name for p in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"pass names must be unique, got {names}")
        self.passes = passes
        # the passes an earlier manager ran over the same program (their names, in order): they count
        # as scheduled before these, and the report's indices continue after them
        self.ran_before = tuple(ran_before)
        self.dump_dir = dump_dir
        self.probe = probe
        self.drift_tol = drift_tol
        self.validate_order()

    def validate_order(self) -> None:
        """Every pass's ``requires`` runs before it: a cycle, or a prerequisite missing or scheduled
        later, is a ``ValueError`` (the cycle named first: no order could satisfy it)."""
        position = {name: i - len(self.ran_before) for i, name in enumerate(self.ran_before)}
        position.update({p.name: i for i, p in enumerate(self.passes)})
        needs = nx.DiGraph([(req, p.name) for p in self.passes for req in p.requires])
        try:
            cycle = nx.find_cycle(needs)
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            raise ValueError(f"pass requirements form a cycle: {' -> '.join(a for a, _ in cycle)}")
        for p in self.passes:
            for req in p.requires:
                if req not in position:
                    raise ValueError(f"pass {p.name!r} requires {req!r}, which is not in the pipeline {list(position)}")
                if position[req] > position[p.name]:
                    raise ValueError(f"pass {p.name!r} requires {req!r}, which is scheduled after it")

    def run(self, program: Program, ctx: PassContext) -> PassReport:
        report = PassReport()
        start = time.perf_counter()
        total = len(self.ran_before) + len(self.passes)
        log.info("running %d passes: %s", len(self.passes), ", ".join(p.name for p in self.passes))
        reference = self._probe(program) if self.probe else None
        self._dump(0, "captured", program, report)
        for i, p in enumerate(self.passes, start=len(self.ran_before) + 1):
            before = program.node_count()
            reason = p.skip_reason(program, ctx)
            if reason is not None:
                report.records.append(PassRecord(i, p.name, "skipped", 0.0, 0, before, before, reason))
                self._dump(i, p.name, program, report)  # index.md lists every pass, skipped ones too
                continue
            t0 = time.perf_counter()
            if p.runs_graphs:  # compiles or runs code: may take long, so say when it starts
                log.info("pass %d/%d %s: started", i, total, p.name)
                program.recompile()
            result = p.run(program, ctx)
            for gm in program.graphs.values():
                gm.graph.lint()
            dt = (time.perf_counter() - t0) * 1e3
            rec = PassRecord(i, p.name, "ran", dt, result.matches, before, program.node_count(), result.note,
                             details=result.details)
            if reference is not None:
                out = self._probe(program)
                rec.max_drift = float((out.float() - reference.float()).abs().max())
                if rec.max_drift > self.drift_tol and report.first_drift is None:
                    report.first_drift = p.name
            report.records.append(rec)
            if dt >= SLOW_PASS_S * 1e3:
                log.info("pass %d/%d %s: %.1f s", i, total, p.name, dt / 1e3)
            self._dump(i, p.name, program, report)
        program.recompile()
        log.info("passes done in %.1f s", time.perf_counter() - start)
        return report

    def _probe(self, program: Program) -> torch.Tensor:
        program.recompile()
        with torch.no_grad():
            return self.probe(program)

    def _dump(self, index: int, name: str, program: Program, report: PassReport) -> None:
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        stem = os.path.join(self.dump_dir, f"{index:02d}_{name}")
        code, table = [], []
        for phase, gm in program.graphs.items():
            code.append(f"# ===== graph: {phase} =====\n")
            code.append(gm.print_readable(print_output=False, include_stride=False, include_device=False))
            table.append(f"# graph: {phase}")
            table.append(f"{'node':40} {'op':14} {'shape:dtype':28} target")
            for n in gm.graph.nodes:
                target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                if n.op == "call_function":
                    target = str(n.target)
                table.append(f"{n.name:40} {n.op:14} {describe_value(n.meta.get('val')):28} {target}")
            table.append("")
        with open(stem + ".py", "w") as f:
            f.write("\n".join(code))
        with open(stem + ".txt", "w") as f:
            f.write("\n".join(table))
        with open(os.path.join(self.dump_dir, "index.md"), "w") as f:
            f.write("# devin-compile pass report\n\n")
            f.write("Files: `NN_<pass>.py` (code), `NN_<pass>.txt` (nodes with shape:dtype); "
                    "`00_captured` is the graph before any pass.\n\n")
            f.write(report.as_markdown() + "\n")
