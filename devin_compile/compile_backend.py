"""The ``devin`` torch.compile backend (registered via the ``torch_dynamo_backends`` entry point).

``torch.compile(model, backend="devin", options={...})`` runs the passes that apply to
any graph, then hands the graph to Inductor:

- on Dynamo's graph: the ``cleanup`` pass through the PassManager (report + optional dumps);
- on Inductor's post-grad ATen graph: the same no-op removal (``x.to(own dtype)``,
  eval-mode dropout, transpose pairs) as a custom post-grad pass.

The paged-KV passes are not applied here: Dynamo graphs of ``model.generate()`` carry
HF's own cache objects, so those rewrites belong to ``optimize()``. Options:
``dump_dir`` (pass dumps), ``inductor`` (a dict of Inductor config patches); any other is a
``ValueError``. The passes get an ``OptimizeConfig`` built from the config options, like
``optimize()``'s (``info`` is None: a Dynamo graph is not a captured model).

Each graph compiled is logged (logger ``devin_compile``, INFO): its number, nodes, whether its sizes
are symbolic, the pass report in one line and the time (passes, Inductor). Dynamo decides which sizes
are symbolic before a backend sees the graph: the first call of ``torch.compile(model,
backend="devin")`` is traced for its own prompt length, and the first call with another length
compiles once more, for every length (then no more). :func:`devin_compile.compile_model` marks the
token dimension dynamic before the first call (:mod:`.dynamic_tokens`): one compile for all lengths.
Inductor's caches (its generated code, AOTAutograd's graphs) live under ``$DEVIN_COMPILE_CACHE/inductor``
unless ``TORCHINDUCTOR_CACHE_DIR`` is set or ``DEVIN_COMPILE_CACHE_OFF=1``.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .compile_cache import off_by_env, use_inductor_cache
from .config import OptimizeConfig
from .passes.cleanup import Cleanup, remove_noops
from .pipeline import PassContext, PassManager, PassReport, Program

log = logging.getLogger(__name__)

#: One PassReport per graph the backend compiled, most recent last.
reports: list[PassReport] = []

# Options the backend takes: OptimizeConfig keys (built into the passes' typed config) and its own.
_CONFIG_OPTIONS = {"dump_dir"}
_BACKEND_OPTIONS = {"inductor"}  # Inductor config patches, applied to the Inductor compile only
_VALID_OPTIONS = _CONFIG_OPTIONS | _BACKEND_OPTIONS


class _PostGradCleanup(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        if remove_noops(graph):
            graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        return hashlib.sha256(b"devin-compile post-grad cleanup v1").digest()


def devin_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict | None = None, **kwargs: Any):
    options = dict(options or {})
    options.update(kwargs.pop("options", None) or {})
    unknown = set(options) - _VALID_OPTIONS
    if unknown:
        raise ValueError(f"backend='devin' got unknown options {sorted(unknown)}; valid: {sorted(_VALID_OPTIONS)}")
    from torch._inductor.compile_fx import compile_fx

    config = OptimizeConfig.from_kwargs({k: v for k, v in options.items() if k in _CONFIG_OPTIONS})
    dump_dir = options.get("dump_dir")  # the option only: DEVIN_COMPILE_DUMP (in config.dump_dir) is optimize()'s
    if dump_dir:
        dump_dir = f"{dump_dir}/graph_{len(reports):02d}"
    start = time.perf_counter()
    nodes = len(gm.graph.nodes)
    report = PassManager([Cleanup()], dump_dir=dump_dir).run(Program({"dynamo": gm}), PassContext(info=None, config=config))
    reports.append(report)
    patches = dict(options.get("inductor") or {})
    patches.setdefault("post_grad_custom_post_pass", _PostGradCleanup())
    passes_s = time.perf_counter() - start
    if not off_by_env():
        use_inductor_cache()  # Inductor's generated code under $DEVIN_COMPILE_CACHE/inductor (see compile_cache)
    before = _cache_counts()
    compiled = compile_fx(gm, example_inputs, config_patches=patches)
    log.info("%s; %s", graph_summary(len(reports) - 1, nodes, example_inputs, report, passes_s,
                                     time.perf_counter() - start - passes_s), _cache_note(before, _cache_counts()))
    return compiled


# torch's own on-disk caches a compile may hit (Dynamo's counters): Inductor's FX-graph cache (the generated
# kernels and wrapper) and AOTAutograd's cache (the traced joint graph), under torch._inductor's cache_dir().
_CACHES = (("Inductor FX-graph cache", "inductor", "fxgraph_cache"),
           ("AOTAutograd cache", "aot_autograd", "autograd_cache"))


def _cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {f"{group}.{key}_{what}": counters[group][f"{key}_{what}"]
            for _, group, key in _CACHES for what in ("hit", "miss")}


def _cache_note(before: dict[str, int], after: dict[str, int]) -> str:
    """What torch's caches did for one compile, e.g. "Inductor FX-graph cache hit, AOTAutograd cache miss"."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    said = []
    for name, group, key in _CACHES:
        hits, misses = (after[f"{group}.{key}_{w}"] - before[f"{group}.{key}_{w}"] for w in ("hit", "miss"))
        if hits and misses:
            said.append(f"{name} {hits} hit, {misses} miss")
        elif hits or misses:
            said.append(f"{name} {'hit' if hits else 'miss'}")
    return (", ".join(said) or "torch's compile caches not consulted") + f" ({cache_dir()})"


def graph_summary(index: int, nodes: int, example_inputs: list[Any], report: PassReport, passes_s: float,
                  inductor_s: float) -> str:
    """The log line of one compiled graph: what was compiled, how, and how long it took."""
    symbols = sorted({str(x) for x in example_inputs if isinstance(x, torch.SymInt)})
    shapes = (f"sizes symbolic in {', '.join(symbols)}: other lengths reuse it" if symbols else
              "static sizes: a call with other sizes compiles again (devin_compile.compile_model marks the "
              "token dimension dynamic from the first call)")
    passes = "; ".join(f"{r.name} {r.status} {r.nodes_before}->{r.nodes_after} nodes" for r in report.records)
    return (f"torch.compile backend 'devin': graph {index} ({nodes} nodes, {shapes}) compiled in "
            f"{passes_s + inductor_s:.1f} s: passes {passes_s:.2f} s ({passes}), Inductor {inductor_s:.1f} s")
