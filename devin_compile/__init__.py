"""devin-compile: an LLM-inference compiler for Hugging Face causal LMs.

``optimize(model)`` captures the model over flattened tokens, rewrites it with an
ordered pipeline of FX passes into graphs that call ``devin::`` ops over a paged KV
cache, and returns an engine-backed model with ``generate`` and ``__call__``.
``torch.compile(model, backend="devin")`` runs the graph-generic passes and Inductor.
"""
from .api import OptimizedModel, optimize
from .capture import UnsupportedModelError
from .config import OptimizeConfig
from .pipeline import PassError
from .offload import pipeline_offload
from .runtime.async_engine import AsyncEngine
from .runtime.engine import Engine, RequestError
from .config import KVPruneConfig
from .runtime.kv_cache import KVCacheExhaustedError
from .runtime.kv_prune import enable_kv_pruning
from .runtime.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine", "pipeline_offload",
    "optimize", "OptimizedModel", "OptimizeConfig", "SamplingParams", "Engine", "UnsupportedModelError",
    "PassError", "RequestError", "KVCacheExhaustedError", "KVPruneConfig", "enable_kv_pruning", "__version__",
]
