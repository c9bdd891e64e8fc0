"""Configuration: one small dataclass per concern, validated when built.

Every check runs in ``__post_init__`` so an invalid setting raises ``ValueError``
before any capture or allocation work starts.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(value: Any) -> torch.dtype | None:
    """Accept a torch dtype, a name like ``"bf16"``, or None (keep the model's)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"dtype={value!r} is not supported; use one of {sorted(_DTYPES)} or a torch.dtype")


@dataclass
class CacheConfig:
    """Paged KV pool: block size and how much memory the pool may take.

    ``num_blocks`` wins over ``memory_bytes`` which wins over ``memory_fraction``
    (a fraction of free device memory; on CPU, of available RAM).
    ``enable_prefix_caching`` shares full KV blocks between requests with a common prefix.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    memory_fraction: float = 0.05
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size!r} must be a positive power of two (e.g. 16)")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks={self.num_blocks!r} must be a positive integer")
        if self.memory_bytes is not None and (not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0):
            raise ValueError(f"kv_cache_memory={self.memory_bytes!r} must be a positive number of bytes")
        if not (0.0 < float(self.memory_fraction) <= 0.95):
            raise ValueError(f"kv_cache_fraction={self.memory_fraction!r} must be in (0, 0.95]")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")


@dataclass
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be an integer >= 2")


@dataclass
class OptimizeConfig:
    """Everything ``optimize()`` accepts besides the model and tokenizer.

    Unknown keys are rejected by :meth:`from_kwargs` with the list of valid ones.
    """

    dtype: torch.dtype | None = None
    device: str | None = None
    attention_backend: str | None = None  # None: registry picks (env DEVIN_ATTENTION_BACKEND overrides)
    verify: bool = False
    dump_dir: str | None = None
    fuse_rms_norm: bool = True
    fuse_rotary: bool = True
    fuse_projections: bool = True
    prepack_linear: bool = True
    split_phases: bool = True
    # Decode batch sizes the decode graph is specialised for; static-shape decode callables
    # (CUDA Graphs, ahead-compiled CPU decode) exist per bucket, batches pad up to one.
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    # Weight-only INT4 (issue 4): a dict of quant.QuantConfig keys (method, bits, group_size, target, ...)
    # to calibrate and quantize now, or ``quantized="dir/"`` to load a saved artifact.
    quantization: Any = None
    quantized: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device={self.device!r} is not a valid torch device: {e}") from None
        if self.attention_backend is not None:
            from .backends.registry import backend_names

            if self.attention_backend not in backend_names():
                raise ValueError(
                    f"attention_backend={self.attention_backend!r} is unknown; valid: {backend_names()}"
                )
        buckets = self.decode_buckets
        if (not isinstance(buckets, (list, tuple)) or not buckets
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)):
            raise ValueError(f"decode_buckets={buckets!r} must be a non-empty list of positive integers, "
                             "e.g. (1, 2, 4, 8, 16, 32, 64, 128)")
        self.decode_buckets = tuple(sorted(set(buckets)))
        from .quant.quantize import RUNTIME_KEYS, QuantConfig

        if self.quantized is not None:
            if not isinstance(self.quantized, (str, os.PathLike)) or not os.path.isdir(self.quantized):
                raise ValueError(f"quantized={self.quantized!r} is not a directory (write one with "
                                 "`devin-compile quantize run --out DIR`)")
            fixed = sorted(set(self.quantization or {}) - set(RUNTIME_KEYS)) if isinstance(self.quantization, Mapping) else []
            if fixed:
                raise ValueError(f"quantization keys {fixed} are fixed by the artifact in {self.quantized}; "
                                 f"with quantized= only {list(RUNTIME_KEYS)} may be given")
            QuantConfig.coerce(self.quantization or {})  # validate; the artifact's own settings fill the rest
            self.quantization = dict(self.quantization or {})
        else:
            self.quantization = QuantConfig.coerce(self.quantization)
        if self.dump_dir is None:
            self.dump_dir = os.environ.get("DEVIN_COMPILE_DUMP") or None

    # Flat keyword names users pass to optimize(), mapped onto the nested dataclasses.
    _FLAT = {
        "block_size": ("cache", "block_size"),
        "num_kv_blocks": ("cache", "num_blocks"),
        "kv_cache_memory": ("cache", "memory_bytes"),
        "kv_cache_fraction": ("cache", "memory_fraction"),
        "enable_prefix_caching": ("cache", "enable_prefix_caching"),
        "max_num_seqs": ("scheduler", "max_num_seqs"),
        "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
        "max_model_len": ("scheduler", "max_model_len"),
    }

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "OptimizeConfig":
        top = {f.name for f in dataclasses.fields(cls)}
        direct: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}}
        for key, value in kwargs.items():
            if key in cls._FLAT:
                group, name = cls._FLAT[key]
                nested[group][name] = value
            elif key in top and key not in nested:
                direct[key] = value
            else:
                valid = sorted((top - set(nested)) | set(cls._FLAT))
                raise ValueError(f"optimize() got an unknown option {key!r}; valid options: {valid}")
        return cls(cache=CacheConfig(**nested["cache"]), scheduler=SchedulerConfig(**nested["scheduler"]), **direct)
