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
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .config import OptimizeConfig
from .passes.cleanup import Cleanup, remove_noops
from .pipeline import PassContext, PassManager, PassReport, Program

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
    report = PassManager([Cleanup()], dump_dir=dump_dir).run(Program({"dynamo": gm}), PassContext(info=None, config=config))
    reports.append(report)
    patches = dict(options.get("inductor") or {})
    patches.setdefault("post_grad_custom_post_pass", _PostGradCleanup())
    return compile_fx(gm, example_inputs, config_patches=patches)
