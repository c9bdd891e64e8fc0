"""``OptimizeConfig``: everything ``optimize()`` accepts besides the model and tokenizer.

Fields hold typed values (a :class:`~.kv_prune.KVPruneConfig`, a ``torch.dtype``, ...);
:meth:`OptimizeConfig.from_kwargs` is where user input is parsed: flat option names are filed
into their groups (``block_size`` → ``cache``, ``fuse_rms_norm`` → ``passes``) and dicts, True
and names are coerced (:func:`coerce_options`). Every check runs in ``__post_init__``, so an
invalid setting raises ``ValueError`` before any capture or allocation work starts.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..validation import flag, int_at_least, is_int, one_of
from .cache import CacheConfig
from .kv_prune import KVPruneConfig
from .pass_options import PassOptions
from .scheduler import SchedulerConfig
from .speculative import SpeculativeConfig
from .tensor_parallel import check_options as check_tensor_parallel

if TYPE_CHECKING:
    from ..cache.config import TierConfig
    from ..quant.config import QuantConfig

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
class OptimizeConfig:
    """Everything ``optimize()`` accepts besides the model and tokenizer.

    Unknown keys are rejected by :meth:`from_kwargs` with the list of valid ones.
    """

    dtype: torch.dtype | None = None
    device: str | None = None
    attention_backend: str | None = None  # None: registry picks (env DEVIN_ATTENTION_BACKEND overrides)
    verify: bool = False
    dump_dir: str | None = None
    # Build backend kernels in optimize() (the CPU decode-attention kernel: ~1 s the first time,
    # then cached) rather than in the first step that needs them.
    warmup: bool = True
    # CPU: compile the decode graph ahead with Inductor, one callable per decode bucket
    # (costs ~45-80 s per model in optimize(); at batch 1 on a 2-core AVX2 CPU 1.4x faster than the eager
    # decode graph in bf16, 1.6x with INT4, but 0.79x on an earlier CPU; on a 2-core Intel Xeon with AMX
    # 1.04x bf16 / 0.97x fp32, and 0.73x / 0.94x with {"freezing": False}; see passes/compile_decode.py).
    # The program before it is compile-cached; Inductor caches its own compile only with freezing off (README).
    compile_decode: bool = False
    # Inductor config overrides for compile_decode, as torch.compile(options=...) takes them, over its
    # defaults {"freezing": True, "cpp_wrapper": True} (passes/compile_decode.py DEFAULTS; the C++ wrapper,
    # no Python between the kernels: SmolLM2 bf16 on a 2-core Intel AMX Xeon 1.16x the Python wrapper at
    # batch 1, 1.12x at 64 rows, INT4 1.33x the eager graph; ~20% longer compile), e.g. {"cpp_wrapper": False}.
    compile_decode_options: dict = field(default_factory=dict)
    # The on-disk compile cache (devin_compile/compile_cache): a program compiled before from the same
    # weights, model, options and versions is read instead of captured and compiled again, and stored
    # when not. True: under $DEVIN_COMPILE_CACHE (default ~/.cache/devin_compile) unless
    # DEVIN_COMPILE_CACHE_OFF=1; a folder (str): that cache root; False: off.
    compile_cache: bool | str = True
    # CUDA Graph decode steps (wrap_cuda_graphs): how many times a replayed step whose logits hold
    # NaN/inf is recomputed uncaptured before its non-finite rows fail their requests alone.
    cuda_graph_recompute_depth: int = 1
    # Modules to run on the CPU while the rest runs on the accelerator, e.g. ("embed_tokens", "lm_head").
    offload_layers: tuple[str, ...] = ()
    # Decode batch sizes the decode graph is specialised for; static-shape decode callables
    # (CUDA Graphs, ahead-compiled CPU decode) exist per bucket, batches pad up to one.
    decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    # Compile devin::kv_prune nodes and prune the KV cache while decoding (None: off).
    kv_prune: KVPruneConfig | None = None
    # Weight-only quantization: the quant.QuantConfig to calibrate and quantize with now; with
    # ``quantized="dir/"`` (load a saved artifact) a dict of the runtime keys (quant.config.RUNTIME_KEYS)
    # that override the artifact's settings.
    quantization: QuantConfig | dict[str, Any] | None = None
    quantized: str | None = None
    # OptimizedModel.quant_result with its tensors (to save or simulate weights quantized in optimize()):
    # a second copy of every quantized weight. False: quant_result is the report without them.
    keep_quant_result: bool = False
    # KV cache tiers under the paged pool, fastest first (devin_compile/cache/config.py); None: none.
    kv_cache_tiers: tuple[TierConfig, ...] | None = None
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
    # Ranks to split every decoder layer over (config/tensor_parallel.py); 1: no tensor parallelism.
    tensor_parallel: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    passes: PassOptions = field(default_factory=PassOptions)

    def __post_init__(self) -> None:
        self._check_types()
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device={self.device!r} is not a valid torch device: {e}") from None
        if self.attention_backend is not None:
            from ..backends.attention.registry import backend_names  # lazily: importing config loads no backend

            one_of("attention_backend", self.attention_backend, backend_names())
        for name in ("compile_decode", "warmup", "keep_quant_result"):
            flag(name, getattr(self, name))
        if not isinstance(self.compile_cache, (bool, str)) or self.compile_cache == "":
            raise ValueError(f"compile_cache={self.compile_cache!r} must be True, False or a cache folder (a str)")
        self._check_compile_decode()
        int_at_least("cuda_graph_recompute_depth", self.cuda_graph_recompute_depth, 0)
        buckets = self.decode_buckets
        if (not isinstance(buckets, (list, tuple)) or not buckets
                or any(not is_int(b) or b < 1 for b in buckets)):
            raise ValueError(f"decode_buckets={buckets!r} must be a non-empty list of positive integers, "
                             "e.g. (1, 2, 4, 8, 16, 32, 64, 128)")
        self.decode_buckets = tuple(sorted(set(buckets)))
        if self.kv_prune is not None and not self.passes.split_phases:
            raise ValueError("kv_prune= needs split_phases=True (the kv_prune nodes live in the decode graph)")
        if self.kv_prune is not None and self.compile_decode:
            raise ValueError("kv_prune= with compile_decode=True is not supported yet (the ahead-compiled decode "
                             "callables would need the kv_prune nodes kept opaque); drop one of them")
        if self.quantized is not None:
            _check_quantized_dir(self.quantized)
        check_tensor_parallel(self)
        if self.dump_dir is None:
            self.dump_dir = os.environ.get("DEVIN_COMPILE_DUMP") or None

    def _check_types(self) -> None:
        """Fields hold typed values; user input (dicts, True, names) is coerced by :meth:`from_kwargs`."""
        from ..cache.config import BACKENDS  # lazily, like quant's
        from ..quant.config import QuantConfig  # lazily: quant/ pulls in the INT4 format

        quant_kind, quant_what = ((Mapping, "a dict of runtime keys (with quantized=)") if self.quantized is not None
                                  else (QuantConfig, "a QuantConfig"))
        tiers = self.kv_cache_tiers
        checks = (
            ("dtype", isinstance(self.dtype, torch.dtype), "a torch.dtype"),
            ("kv_prune", isinstance(self.kv_prune, KVPruneConfig), "a KVPruneConfig"),
            ("speculative", isinstance(self.speculative, SpeculativeConfig), "a SpeculativeConfig"),
            ("quantization", isinstance(self.quantization, quant_kind), quant_what),
            ("kv_cache_tiers", isinstance(tiers, tuple) and all(isinstance(t, tuple(BACKENDS.values())) for t in tiers),
             "a tuple of tier configs (cache.config)"),
        )
        for name, ok, what in checks:
            if getattr(self, name) is not None and not ok:
                raise ValueError(f"OptimizeConfig({name}={getattr(self, name)!r}): must be {what} or None; "
                                 "OptimizeConfig.from_kwargs (what optimize() calls) also takes dicts, True and names")
        for name, kind in _GROUPS.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"OptimizeConfig({name}=...) must be a {kind.__name__}, "
                                 f"got {type(getattr(self, name)).__name__}")

    def _check_compile_decode(self) -> None:
        if self.compile_decode and not self.passes.split_phases:
            raise ValueError("compile_decode=True needs split_phases=True (it compiles the decode graph)")
        opts = self.compile_decode_options
        if not isinstance(opts, Mapping):
            raise ValueError(f"compile_decode_options={opts!r} must be a dict of Inductor config keys, "
                             "e.g. {'cpp_wrapper': False}")
        if opts and not self.compile_decode:
            raise ValueError("compile_decode_options= needs compile_decode=True (they configure its Inductor compile)")
        if opts:
            import torch._inductor.config as inductor_config

            unknown = sorted(str(k) for k in opts if not isinstance(k, str) or not hasattr(inductor_config, k))
            if unknown:
                raise ValueError(f"compile_decode_options has keys torch._inductor.config does not know: {unknown} "
                                 "(e.g. 'cpp_wrapper', 'max_autotune')")
        self.compile_decode_options = dict(opts)

    def limited_to_step_tokens(self, n: int) -> "OptimizeConfig":
        """This config with no step packing more than ``n`` tokens (a model whose captured graph holds
        only up to ``n``; ``ModelInfo.max_step_tokens``): the scheduler's token and sequence limits,
        the decode buckets and the speculative verify tokens capped at ``n``."""
        sched = dataclasses.replace(self.scheduler, max_num_batched_tokens=min(self.scheduler.max_num_batched_tokens, n),
                                    max_num_seqs=min(self.scheduler.max_num_seqs, n))
        spec = self.speculative
        if spec is not None:
            spec = dataclasses.replace(spec, max_verify_tokens=min(spec.max_verify_tokens, n))
        buckets = tuple(b for b in self.decode_buckets if b <= n) or (n,)
        return dataclasses.replace(self, scheduler=sched, speculative=spec, decode_buckets=buckets)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "OptimizeConfig":
        """Flat user options (``optimize(**options)``, the CLI's ``--option``) → a validated config."""
        top = {f.name for f in dataclasses.fields(cls)}
        direct: dict[str, Any] = {}
        grouped: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
        for key, value in kwargs.items():
            if key in FLAT_OPTIONS:
                group, name = FLAT_OPTIONS[key]
                grouped[group][name] = value
            elif key in top and key not in _GROUPS:
                direct[key] = value
            else:
                valid = sorted((top - set(_GROUPS)) | set(FLAT_OPTIONS))
                raise ValueError(f"optimize() got an unknown option {key!r}; valid options: {valid}")
        groups = {group: kind(**grouped[group]) for group, kind in _GROUPS.items()}
        return cls(**groups, **coerce_options(direct))


#: The option groups of :class:`OptimizeConfig`, by field name.
_GROUPS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "passes": PassOptions}

#: Flat keyword names users pass to optimize(), mapped onto the option groups.
FLAT_OPTIONS: dict[str, tuple[str, str]] = {
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
    **{f.name: ("passes", f.name) for f in dataclasses.fields(PassOptions)},
}


def coerce_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """User input for :class:`OptimizeConfig`'s own fields → typed values: a dtype name → ``torch.dtype``;
    ``kv_prune`` True/dict → :class:`KVPruneConfig`; ``speculative`` method name/dict →
    :class:`SpeculativeConfig`; ``kv_cache_tiers`` list of dicts → tier configs; ``quantization`` dict →
    ``QuantConfig`` (with ``quantized=``, a checked dict of runtime keys). Other keys pass unchanged."""
    out = dict(options)
    if "dtype" in out:
        out["dtype"] = parse_dtype(out["dtype"])
    if "kv_prune" in out:
        out["kv_prune"] = KVPruneConfig.coerce(out["kv_prune"])
    if "quantization" in out or "quantized" in out:
        out["quantization"] = coerce_quantization(out.get("quantization"), out.get("quantized"))
    if "speculative" in out:
        out["speculative"] = SpeculativeConfig.coerce(out["speculative"])
    if "kv_cache_tiers" in out:
        from ..cache.config import coerce as coerce_kv_cache_tiers  # lazily, like quant's

        out["kv_cache_tiers"] = coerce_kv_cache_tiers(out["kv_cache_tiers"])
    return out


def coerce_quantization(quantization: Any, quantized: Any) -> QuantConfig | dict[str, Any] | None:
    """``quantization={...}`` becomes a QuantConfig; with ``quantized="dir/"`` only the runtime keys
    may be given (the artifact's own settings fill the rest when it is loaded)."""
    from ..quant.config import RUNTIME_KEYS, QuantConfig  # lazily: quant/ pulls in the INT4 format

    if quantized is None:
        return QuantConfig.coerce(quantization)
    _check_quantized_dir(quantized)
    fixed = sorted(set(quantization or {}) - set(RUNTIME_KEYS)) if isinstance(quantization, Mapping) else []
    if fixed:
        raise ValueError(f"quantization keys {fixed} are fixed by the artifact in {quantized}; "
                         f"with quantized= only {list(RUNTIME_KEYS)} may be given")
    QuantConfig.coerce(quantization or {})  # validate
    return dict(quantization or {})


def _check_quantized_dir(quantized: Any) -> None:
    if not isinstance(quantized, (str, os.PathLike)) or not os.path.isdir(quantized):
        raise ValueError(f"quantized={quantized!r} is not a directory (write one with "
                         "`devin-compile quantize run --out DIR`)")
