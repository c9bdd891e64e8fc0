"""devin-compile: an LLM-inference compiler for Hugging Face causal LMs.

``optimize(model)`` captures the model over flattened tokens, rewrites it with an
ordered pipeline of FX passes into graphs that call ``devin::`` ops over a paged KV
cache, and returns an engine-backed model with ``generate`` and ``__call__``.
``torch.compile(model, backend="devin")`` runs the graph-generic passes and Inductor;
``compile_model(model)`` does that for every prompt length from the first call.

The public names below are imported on first use, so ``import devin_compile.cli`` (the
``devin-compile`` command) does not pay for torch and transformers before it needs them.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name → the module that defines it
_EXPORTS = {
    "optimize": ".api", "OptimizedModel": ".api",
    "compile_model": ".dynamic_tokens",
    "UnsupportedModelError": ".capture",
    "OptimizeConfig": ".config", "KVPruneConfig": ".config",
    "PassError": ".pipeline",
    "pipeline_offload": ".offload",
    "AsyncEngine": ".runtime.async_engine",
    "Engine": ".runtime.engine", "RequestError": ".runtime.engine",
    "KVCacheExhaustedError": ".runtime.kv_cache",
    "enable_kv_pruning": ".runtime.kv_prune",
    "SamplingParams": ".runtime.sampling",
}

__all__ = [
    "AsyncEngine", "pipeline_offload",
    "optimize", "OptimizedModel", "compile_model", "OptimizeConfig", "SamplingParams", "Engine", "UnsupportedModelError",
    "PassError", "RequestError", "KVCacheExhaustedError", "KVPruneConfig", "enable_kv_pruning", "__version__",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'devin_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
