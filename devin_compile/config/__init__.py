"""Configuration: one small dataclass per concern, validated when built.

Every check runs in ``__post_init__`` so an invalid setting raises ``ValueError`` before any
capture or allocation work starts; user input (flat option names, dicts, True, names) is parsed
by :meth:`OptimizeConfig.from_kwargs`.

- :mod:`.cache`: :class:`CacheConfig` (the paged KV pool);
- :mod:`.scheduler`: :class:`SchedulerConfig` (batching limits, step mode);
- :mod:`.kv_prune`: :class:`KVPruneConfig`;
- :mod:`.speculative`: :class:`SpeculativeConfig`, :class:`SpeculativeRequest`;
- :mod:`.pass_options`: :class:`PassOptions` (which optional passes run);
- :mod:`.optimize`: :class:`OptimizeConfig` (all of the above, plus dtype, device, quantization, ...).
"""
from .cache import CacheConfig
from .kv_prune import KVPruneConfig
from .optimize import DEFAULT_DECODE_BUCKETS, FLAT_OPTIONS, OptimizeConfig, coerce_options, parse_dtype
from .pass_options import PassOptions
from .scheduler import SchedulerConfig
from .speculative import SPEC_METHODS, SpeculativeConfig, SpeculativeRequest

__all__ = ["CacheConfig", "DEFAULT_DECODE_BUCKETS", "FLAT_OPTIONS", "KVPruneConfig", "OptimizeConfig", "PassOptions",
           "SPEC_METHODS", "SchedulerConfig", "SpeculativeConfig", "SpeculativeRequest", "coerce_options",
           "parse_dtype"]
