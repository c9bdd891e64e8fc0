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

from .validation import flag, fraction, from_mapping, int_at_least, is_int, number_in, one_of, positive_int

#: Decode batch sizes the decode graph is specialised for, unless ``decode_buckets=`` says otherwise.
DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

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
        if not is_int(self.block_size) or self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size!r} must be a positive power of two (e.g. 16)")
        positive_int("num_blocks", self.num_blocks, optional=True)
        positive_int("kv_cache_memory", self.memory_bytes, optional=True, hint="bytes")
        fraction("kv_cache_fraction", self.memory_fraction, 0.0, 0.95)
        flag("enable_prefix_caching", self.enable_prefix_caching)


@dataclass
class SchedulerConfig:
    """Continuous batching limits for one engine step, and how arriving requests join.

    ``step_mode``: ``"mixed"`` steps decode the running sequences and prefill (chunks of)
    new prompts together; ``"separate"`` steps are either prefill-only (whenever prompt
    work is pending) or decode-only. Dynamic batching: waiting requests are admitted once
    ``min_batch_size`` of them are waiting or the oldest has waited ``max_wait_ms``,
    whichever comes first (defaults: admit at once).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    step_mode: str = "mixed"
    min_batch_size: int = 1
    max_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "min_batch_size"):
            positive_int(name, getattr(self, name))
        one_of("step_mode", self.step_mode, ("mixed", "separate"))
        number_in("max_wait_ms", self.max_wait_ms, 0, hint="milliseconds")
        int_at_least("max_model_len", self.max_model_len, 2, optional=True)


@dataclass
class KVPruneConfig:
    """Dynamic KV-cache pruning while decoding (see :mod:`devin_compile.runtime.kv_prune`).

    Every ``step_interval`` decode steps a sequence's tokens whose normalised attention score
    (mean over the observed steps of ``attention mass x live tokens``, so 1.0 = uniform) is
    below ``threshold`` are evicted, never the first ``sink_tokens`` nor the last
    ``recent_tokens``; ``max_tokens`` / ``max_ratio`` (of the sequence's positions) cap the
    live tokens. ``policy``: ``"attention"`` (scores), ``"streaming"`` (evict the oldest
    non-sink tokens: StreamingLLM) or ``"random"`` (a baseline; ``seed``). ``recency_layers``:
    the fraction of the attention layers, counted from the first, that evict their oldest
    evictable tokens whatever the policy (default 0.5: on SmolLM2, scores chose worse than
    recency in the early layers and better in the late ones; 0 = the policy in every layer).
    ``enabled=False`` compiles the pruning nodes but leaves pruning off until a request
    (``SamplingParams(kv_prune=...)``) or :func:`devin_compile.enable_kv_pruning` turns it on.
    """

    threshold: float = 0.05
    step_interval: int = 2
    sink_tokens: int = 4
    recent_tokens: int = 64
    max_tokens: int | None = None
    max_ratio: float | None = None
    policy: str = "attention"
    seed: int = 0
    prefill_window: int = 0  # > 0: SnapKV-style, the prompt's last N queries score it and it is pruned once at once
    pool_kernel: int = 32  # > 1: a token's score is the max over it and the kernel-1 tokens before it (keeps spans)
    recency_layers: float = 0.5  # fraction of layers (first ones) that evict by recency instead of by the policy
    enabled: bool = True

    POLICIES = ("attention", "streaming", "random")

    def __post_init__(self) -> None:
        number_in("kv_prune.threshold", self.threshold, 0.0, 1.0, hi_open=True,
                  hint="a fraction of uniform attention; 0 evicts nothing unless a cap is set")
        positive_int("kv_prune.step_interval", self.step_interval, hint="decode steps between evaluations")
        for name in ("sink_tokens", "recent_tokens", "seed", "prefill_window"):
            int_at_least(f"kv_prune.{name}", getattr(self, name), 0)
        positive_int("kv_prune.max_tokens", self.max_tokens, optional=True)
        protected = self.sink_tokens + self.recent_tokens
        if self.max_tokens is not None and self.max_tokens < max(protected, 1):
            raise ValueError(
                f"kv_prune.max_tokens={self.max_tokens} is smaller than sink_tokens + recent_tokens = {protected}: "
                "the cap could only be met by evicting every token; raise max_tokens or lower the windows")
        fraction("kv_prune.max_ratio", self.max_ratio, optional=True, hint="live tokens / positions")
        positive_int("kv_prune.pool_kernel", self.pool_kernel, hint="1: no pooling")
        number_in("kv_prune.recency_layers", self.recency_layers, 0.0, 1.0,
                  hint="the fraction of attention layers, from the first, that evict their oldest tokens")
        one_of("kv_prune.policy", self.policy, self.POLICIES)
        if self.policy != "attention" and not self.has_cap:
            raise ValueError(f"kv_prune.policy={self.policy!r} ignores scores, so it needs a cap: set max_tokens or "
                             "max_ratio")
        flag("kv_prune.enabled", self.enabled)

    @property
    def has_cap(self) -> bool:
        return self.max_tokens is not None or self.max_ratio is not None

    def num_recency_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers (the first ones) evict by recency."""
        return round(self.recency_layers * num_layers)

    @classmethod
    def coerce(cls, value: Any, what: str = "kv_prune") -> "KVPruneConfig | None":
        """None/False → None (off); True → defaults; a dict or KVPruneConfig → validated config."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return from_mapping(cls, value, what)
        raise ValueError(f"{what}={value!r} must be a dict of settings (e.g. {{'threshold': 0.05}}), "
                         "a KVPruneConfig, True or None")


SPEC_METHODS = ("ngram", "draft", "head")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (see :mod:`devin_compile.runtime.speculative`).

    ``method``: ``"ngram"`` (prompt/context lookup: the longest suffix of ``max_ngram`` down to
    ``min_ngram`` tokens seen before proposes what followed it), ``"draft"`` (``model``: any HF
    causal LM with the target's vocabulary, compiled by devin-compile with ``draft_options``; or
    ``"self-int4"``: an RTN INT4 copy of the target) or ``"head"`` (self-speculative: the target's
    first ``layers`` decoder layers, plus its last ``last_layers``, with its final norm and lm_head,
    sharing its weights). ``num_tokens``: the most tokens proposed per step. A draft stops
    proposing when its own probability of the next token is below ``acceptance_threshold``.
    ``adaptive``: each request's length follows its recent acceptance (longer when all are
    accepted, shorter when rejected, paused with growing back-off while acceptance stays low).
    ``max_verify_tokens``: a step's verify tokens (sequences x (1 + proposed)) are kept at or
    below it, so speculation turns itself down as the batch grows (16: off from 16 sequences
    on). ``recompute_depth``: how many times a verify step whose logits hold NaN/inf is
    recomputed before its request fails.
    """

    method: str = "ngram"
    num_tokens: int = 4
    min_ngram: int = 1
    max_ngram: int = 4
    model: Any = None
    draft_options: dict = field(default_factory=dict)
    layers: int = 2
    last_layers: int = 0
    acceptance_threshold: float = 0.0
    adaptive: bool = True
    max_verify_tokens: int = 16
    recompute_depth: int = 3

    def __post_init__(self) -> None:
        one_of("speculative.method", self.method, SPEC_METHODS)
        positive_int("speculative.num_tokens", self.num_tokens, hint="tokens proposed per step")
        positive_int("speculative.min_ngram", self.min_ngram)
        positive_int("speculative.max_ngram", self.max_ngram)
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"speculative.max_ngram={self.max_ngram} is below min_ngram={self.min_ngram}")
        positive_int("speculative.layers", self.layers, hint="the target's first decoder layers the head runs")
        int_at_least("speculative.last_layers", self.last_layers, 0)
        number_in("speculative.acceptance_threshold", self.acceptance_threshold, 0.0, 1.0, hi_open=True,
                  hint="the draft's own probability below which it stops proposing; 0: off")
        flag("speculative.adaptive", self.adaptive)
        positive_int("speculative.max_verify_tokens", self.max_verify_tokens,
                     hint="verify tokens per step, sequences x (1 + proposed)")
        int_at_least("speculative.recompute_depth", self.recompute_depth, 0)
        if not isinstance(self.draft_options, Mapping):
            raise ValueError(f"speculative.draft_options={self.draft_options!r} must be a dict of optimize() options")
        if self.method == "draft":
            if self.model is None:
                raise ValueError("speculative.method='draft' needs model=: an HF causal LM with the target's "
                                 "vocabulary, or 'self-int4'")
            if isinstance(self.model, str) and self.model != "self-int4":
                raise ValueError(f"speculative.model={self.model!r}: give a model object or 'self-int4'")
        elif self.model is not None:
            raise ValueError(f"speculative.model= is for method='draft', not method={self.method!r}")
        if self.draft_options and self.method == "ngram":
            raise ValueError("speculative.draft_options= is for the draft and head methods; ngram has no model")

    @classmethod
    def coerce(cls, value: Any, what: str = "speculative") -> "SpeculativeConfig | None":
        """None/False → None (off); a method name → its defaults; a dict or SpeculativeConfig → validated."""
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, Mapping):
            return from_mapping(cls, value, what)
        raise ValueError(f"{what}={value!r} must be a method name ({', '.join(SPEC_METHODS)}), a dict "
                         "(e.g. {'method': 'ngram', 'num_tokens': 4}), a SpeculativeConfig, or None")


@dataclass
class SpeculativeRequest:
    """One request's override of the engine's speculation (``SamplingParams(speculative={...})``);
    None keeps the engine's setting."""

    num_tokens: int | None = None
    acceptance_threshold: float | None = None
    adaptive: bool | None = None

    def __post_init__(self) -> None:
        positive_int("speculative.num_tokens", self.num_tokens, optional=True, hint="tokens proposed per step")
        number_in("speculative.acceptance_threshold", self.acceptance_threshold, 0.0, 1.0, hi_open=True,
                  optional=True)
        if self.adaptive is not None:
            flag("speculative.adaptive", self.adaptive)

    @classmethod
    def coerce(cls, value: Any) -> "SpeculativeRequest | bool | None":
        """None (the engine's setting), False (off for this request), True (on, engine settings), or a dict."""
        if value is None or isinstance(value, (bool, cls)):
            return value
        if isinstance(value, Mapping):
            return from_mapping(cls, value, "SamplingParams.speculative")
        raise ValueError(f"SamplingParams.speculative={value!r} must be None, False, True or a dict like "
                         "{'num_tokens': 6, 'acceptance_threshold': 0.3}")


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
    fuse_attention_inputs: bool = True
    fuse_projections: bool = True
    fuse_silu_mul: bool = True
    prepack_linear: bool = True
    # CPU float32: linears → devin::packed_linear (the logits linear; all of them with AVX-512).
    pack_linears: bool = True
    # CPU float32: HF's routed MoE experts → one devin::moe_experts (each selected expert read once a step).
    fuse_moe_experts: bool = True
    # CPU bf16/fp16 without native oneDNN kernels: linears of 8+ rows computed in float32.
    upcast_linear: bool = True
    split_phases: bool = True
    # Build backend kernels in optimize() (the CPU decode-attention kernel: ~1 s the first time,
    # then cached) rather than in the first step that needs them.
    warmup: bool = True
    # CPU: compile the decode graph ahead with Inductor, one callable per decode bucket
    # (costs ~45-80 s per model in optimize(); at batch 1 on a 2-core AVX2 CPU 1.4x faster than the eager
    # decode graph in bf16, 1.6x with INT4, but 0.79x on an earlier CPU; see passes/compile_decode.py).
    compile_decode: bool = False
    # Inductor config overrides for compile_decode, as torch.compile(options=...) takes them, e.g.
    # {"cpp_wrapper": True}: a C++ wrapper instead of Python calls the kernels (SmolLM2 INT4 on a
    # 2-core CPU: ~5% faster decode, but ~2x the compile time).
    compile_decode_options: dict = field(default_factory=dict)
    # Modules to run on the CPU while the rest runs on the accelerator, e.g. ("embed_tokens", "lm_head").
    offload_layers: tuple[str, ...] = ()
    # Decode batch sizes the decode graph is specialised for; static-shape decode callables
    # (CUDA Graphs, ahead-compiled CPU decode) exist per bucket, batches pad up to one.
    decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    kv_prune: Any = None  # KVPruneConfig | dict | True: compile devin::kv_prune nodes (issue 5)
    # Weight-only INT4 (issue 4): a dict of quant.QuantConfig keys (method, bits, group_size, target, ...)
    # to calibrate and quantize now, or ``quantized="dir/"`` to load a saved artifact.
    quantization: Any = None
    quantized: str | None = None
    kv_cache_tiers: Any = None  # list of tier dicts, fastest first (devin_compile/cache/config.py)
    speculative: Any = None  # SpeculativeConfig | dict | method name: speculative decoding (issue 21)
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
            from .backends.attention.registry import backend_names  # lazily: importing config loads no backend

            one_of("attention_backend", self.attention_backend, backend_names())
        for name in ("compile_decode", "warmup", "split_phases"):
            flag(name, getattr(self, name))
        self._check_compile_decode()
        buckets = self.decode_buckets
        if (not isinstance(buckets, (list, tuple)) or not buckets
                or any(not is_int(b) or b < 1 for b in buckets)):
            raise ValueError(f"decode_buckets={buckets!r} must be a non-empty list of positive integers, "
                             "e.g. (1, 2, 4, 8, 16, 32, 64, 128)")
        self.decode_buckets = tuple(sorted(set(buckets)))
        self.kv_prune = KVPruneConfig.coerce(self.kv_prune)
        if self.kv_prune is not None and not self.split_phases:
            raise ValueError("kv_prune= needs split_phases=True (the kv_prune nodes live in the decode graph)")
        if self.kv_prune is not None and self.compile_decode:
            raise ValueError("kv_prune= with compile_decode=True is not supported yet (the ahead-compiled decode "
                             "callables would need the kv_prune nodes kept opaque); drop one of them")
        self._check_quantization()
        self.speculative = SpeculativeConfig.coerce(self.speculative)
        from .cache.config import coerce as coerce_kv_cache_tiers  # lazily, like quant's

        self.kv_cache_tiers = coerce_kv_cache_tiers(self.kv_cache_tiers)
        if self.dump_dir is None:
            self.dump_dir = os.environ.get("DEVIN_COMPILE_DUMP") or None

    def _check_compile_decode(self) -> None:
        if self.compile_decode and not self.split_phases:
            raise ValueError("compile_decode=True needs split_phases=True (it compiles the decode graph)")
        opts = self.compile_decode_options
        if not isinstance(opts, Mapping):
            raise ValueError(f"compile_decode_options={opts!r} must be a dict of Inductor config keys, "
                             "e.g. {'cpp_wrapper': True}")
        if opts and not self.compile_decode:
            raise ValueError("compile_decode_options= needs compile_decode=True (they configure its Inductor compile)")
        if opts:
            import torch._inductor.config as inductor_config

            unknown = sorted(str(k) for k in opts if not isinstance(k, str) or not hasattr(inductor_config, k))
            if unknown:
                raise ValueError(f"compile_decode_options has keys torch._inductor.config does not know: {unknown} "
                                 "(e.g. 'cpp_wrapper', 'max_autotune')")
        self.compile_decode_options = dict(opts)

    def _check_quantization(self) -> None:
        """``quantization={...}`` becomes a QuantConfig; with ``quantized="dir/"`` only the runtime keys
        may be given (the artifact's own settings fill the rest when it is loaded)."""
        from .quant.config import RUNTIME_KEYS, QuantConfig  # lazily: quant/ pulls in the INT4 format

        if self.quantized is None:
            self.quantization = QuantConfig.coerce(self.quantization)
            return
        if not isinstance(self.quantized, (str, os.PathLike)) or not os.path.isdir(self.quantized):
            raise ValueError(f"quantized={self.quantized!r} is not a directory (write one with "
                             "`devin-compile quantize run --out DIR`)")
        fixed = sorted(set(self.quantization or {}) - set(RUNTIME_KEYS)) if isinstance(self.quantization, Mapping) else []
        if fixed:
            raise ValueError(f"quantization keys {fixed} are fixed by the artifact in {self.quantized}; "
                             f"with quantized= only {list(RUNTIME_KEYS)} may be given")
        QuantConfig.coerce(self.quantization or {})  # validate
        self.quantization = dict(self.quantization or {})

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
        "step_mode": ("scheduler", "step_mode"),
        "min_batch_size": ("scheduler", "min_batch_size"),
        "max_wait_ms": ("scheduler", "max_wait_ms"),
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
