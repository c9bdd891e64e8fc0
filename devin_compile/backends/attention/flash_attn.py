"""FlashAttention backends over the paged KV cache (CUDA only).

Two backends, each calling its library's ``flash_attn_with_kvcache``:

``flash_attn3`` (priority 40)
    FlashAttention-3, the Hopper build (``import flash_attn_interface``, also reachable as
    ``flash_attn_3.flash_attn_interface``). Needs compute capability 9.x. Paged KV through
    ``page_table`` (any page size) and a packed, variable-length query through
    ``cu_seqlens_q`` / ``max_seqlen_q`` -- both arrived in the same FA3 revision
    (3.0.0b1, January 2025); a build without ``page_table`` is reported unavailable.
``flash_attn2`` (priority 30)
    FlashAttention-2 (``from flash_attn import flash_attn_with_kvcache``). Needs compute
    capability >= 8.0. Paged KV through ``block_table``; the library requires the page
    size (our cache ``block_size``) to be a multiple of 256. Its kvcache entry point has no
    varlen query, so mixed batches are padded per sequence (see below).

How our step maps onto the library call
---------------------------------------
The new K/V are scattered into the cache first (:func:`.kv_write.write_kv`, which also
skips padded ``-1`` slots), then the library attends over the cache alone (``k=None``,
``v=None``) with ``cache_seqlens = meta.seq_lens`` (the length *after* this step's
writes), ``causal=True`` and block table ``meta.block_tables`` (int32). FlashAttention
aligns the causal mask to the bottom right: query row ``i`` of a ``seqlen_q``-row block
sees keys ``j <= i + seqlen_k - seqlen_q``, which is exactly our slot-causal rule
(query ``i`` of a ``q_len``-token step sees slots ``<= seq_len - q_len + i``) when
``seqlen_q == q_len``. Consequences:

* pure decode: ``q`` becomes ``[B, 1, Hq, D]``;
* FA3 mixed batch: ``q`` stays packed ``[T, Hq, D]`` with ``cu_seqlens_q =
  meta.query_start_loc``, so every sequence has its own ``seqlen_q``;
* FA2 mixed batch: ``q`` is padded to ``[B, max_q, Hq, D]`` with each sequence's tokens
  placed at the *end* of its row (left padding). With ``seqlen_q = max_q`` the bottom-right
  rule then still gives row ``max_q - q_len + i`` the slots ``<= seq_len - q_len + i``;
  the padding rows see fewer (or no) keys -- a fully masked row is documented to come
  out as zeros -- and are dropped when unpadding.

Sliding window: our reference lets the query at slot ``p`` see slot ``j`` iff
``p - window < j <= p``; FA's ``window_size=(left, right)`` lets it see
``[p - left, p + right]``, so ``window_size = (sliding_window - 1, 0)``; ``(-1, -1)``
when there is no window. ``softcap`` is passed through (``0.0`` = off; FA applies
``softcap * tanh(scale * q.k / softcap)``, as the reference does).

Declining calls
---------------
:meth:`supports` takes the protocol's keywords plus an optional ``block_size`` (the KV
cache's page size): with it, FA2 declines block sizes that are not a multiple of
:attr:`FlashAttn2Backend.block_size_multiple` (256). ``forward`` raises a
``ValueError`` naming the required block size if it is handed such a cache anyway.
fp32 (no FA kernel), head dims above 256 and, for FA3, head dims that are not a multiple
of 8 are declined, and so are ALiBi calls where the library has no ``alibi_slopes`` (FA3),
attention sinks (neither library's ``flash_attn_with_kvcache`` takes a sink logit) and chunked
attention where the library has no ``attention_chunk`` (FA2; FA3's lets the query at position p
see keys from ``floor(p / C)·C``, ours). Known FA3 build flags (``flash_attn_config``) that disable
soft-capping, local attention or fp16 are honoured too.

The library function is resolved lazily (importing this module never imports
FlashAttention) and can be injected: ``FlashAttn3Backend(fn=stand_in)`` or
``fa3_forward(..., fn=stand_in)``, which is how the contract test runs on CPU.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import torch

from ...step import AttentionMetadata
from .kv_write import write_kv
from .registry import register_backend

FlashFn = Callable[..., Any]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
FA2_BLOCK_SIZE_MULTIPLE = 256  # "Paged KV cache block size must be divisible by 256" (flash_api.cpp)


def window_size_for(sliding_window: int) -> tuple[int, int]:
    """FA's ``window_size=(left, right)`` for our ``sliding_window`` (<= 0: no window)."""
    return (int(sliding_window) - 1, 0) if sliding_window > 0 else (-1, -1)


def _accepts(fn: FlashFn, *names: str) -> bool:
    """Whether ``fn`` takes every keyword in ``names`` (True when it cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(n in params for n in names)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lib: str) -> None:
    if q.dtype not in _HALF_DTYPES:
        raise ValueError(f"{lib} supports fp16/bf16 only, got q dtype {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"{lib} needs the KV cache in the query dtype ({q.dtype}); got k_cache {k_cache.dtype}, "
            f"v_cache {v_cache.dtype}"
        )


def _num_real_tokens(meta: AttentionMetadata) -> int:
    return int(sum(meta.query_lens_host))


def _finish(out: torch.Tensor, total: int, q: torch.Tensor, dv: int) -> torch.Tensor:
    """Extend ``out`` [total, Hq, Dv] with zero rows for tokens past the last sequence."""
    if total == q.shape[0]:
        return out
    full = q.new_zeros((q.shape[0], q.shape[1], dv))
    full[:total] = out
    return full


def _padded_rows(meta: AttentionMetadata, total: int, max_q: int, device: torch.device) -> torch.Tensor:
    """[total] int64: the row of ``[B * max_q]`` each packed token lands on, left-padded per sequence.

    Token ``i`` of sequence ``b`` (q_len tokens) goes to ``b * max_q + max_q - q_len + i``.
    Built on the device without host syncs.
    """
    qsl = meta.query_start_loc.to(device=device, dtype=torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    seq = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), q_lens, output_size=total)
    tok = torch.arange(total, device=device)
    return seq * max_q + (max_q - q_lens)[seq] + (tok - qsl[seq])


def _is_decode(meta: AttentionMetadata, total: int) -> bool:
    return meta.max_query_len == 1 and total == meta.num_seqs


def _call_padded(q: torch.Tensor, meta: AttentionMetadata, total: int, call) -> torch.Tensor:
    """Run ``call(q4)`` on q padded to [B, max_q, Hq, D]; return the packed [total, Hq, Dv] rows."""
    B, max_q = meta.num_seqs, meta.max_query_len
    Hq, D = q.shape[1], q.shape[2]
    rows = _padded_rows(meta, total, max_q, q.device)
    q_pad = q.new_zeros((B * max_q, Hq, D))
    q_pad.index_copy_(0, rows, q[:total])
    out = _unwrap(call(q_pad.view(B, max_q, Hq, D)))
    return out.reshape(B * max_q, Hq, out.shape[-1]).index_select(0, rows)


def _unwrap(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def fa2_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, *, scale: float, softcap: float, sliding_window: int, fn: FlashFn,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k/v into the cache, then attend with FA2's ``flash_attn_with_kvcache`` (``fn``).

    q: [T, Hq, D], k/v: [T, Hkv, D], caches [num_blocks, block_size, Hkv, D]; returns [T, Hq, Dv].
    ``alibi_slopes`` [Hq] goes to FA2's own ``alibi_slopes`` (fp32): its bias
    ``-slope·|i + seqlen_k − seqlen_q − j|`` is ``slope·(j − qpos)`` on the causal keys, as ours.
    """
    _check_inputs(q, k_cache, v_cache, "FlashAttention-2")
    block_size = k_cache.shape[1]
    if block_size % FA2_BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"FlashAttention-2's paged KV cache needs block_size divisible by {FA2_BLOCK_SIZE_MULTIPLE} "
            f"(got block_size={block_size}); use block_size={FA2_BLOCK_SIZE_MULTIPLE} or the flash_attn3 backend"
        )
    write_kv(k, v, k_cache, v_cache, meta)
    total = _num_real_tokens(meta)
    Hq, Dv = q.shape[1], v_cache.shape[-1]
    if total == 0 or meta.num_seqs == 0:
        return q.new_zeros((q.shape[0], Hq, Dv))

    extra = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes.to(q.device, torch.float32).contiguous()}

    def call(q4: torch.Tensor) -> Any:
        return fn(
            q4, k_cache, v_cache, k=None, v=None,
            cache_seqlens=meta.seq_lens, block_table=meta.block_tables,
            softmax_scale=scale, causal=True, window_size=window_size_for(sliding_window),
            softcap=float(softcap), **extra,
        )

    if _is_decode(meta, total):
        out = _unwrap(call(q[:total].reshape(total, 1, Hq, q.shape[2]))).reshape(total, Hq, -1)
    else:
        out = _call_padded(q, meta, total, call)
    return _finish(out, total, q, Dv)


def fa3_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, *, scale: float, softcap: float, sliding_window: int, fn: FlashFn,
    varlen: bool | None = None, attention_chunk: int = -1,
) -> torch.Tensor:
    """Write k/v into the cache, then attend with FA3's ``flash_attn_with_kvcache`` (``fn``).

    Mixed batches use the packed query (``cu_seqlens_q``/``max_seqlen_q``) when ``varlen``
    (default: when ``fn`` accepts those arguments), else the FA2-style padding. ``attention_chunk``
    > 0 goes to FA3's own ``attention_chunk`` (passed only then, so older builds keep working).
    """
    _check_inputs(q, k_cache, v_cache, "FlashAttention-3")
    write_kv(k, v, k_cache, v_cache, meta)
    total = _num_real_tokens(meta)
    Hq, D, Dv = q.shape[1], q.shape[2], v_cache.shape[-1]
    if total == 0 or meta.num_seqs == 0:
        return q.new_zeros((q.shape[0], Hq, Dv))
    if varlen is None:
        varlen = _accepts(fn, "cu_seqlens_q", "max_seqlen_q")

    chunk = {"attention_chunk": int(attention_chunk)} if attention_chunk > 0 else {}

    def call(qq: torch.Tensor, **extra: Any) -> Any:
        return fn(
            qq, k_cache, v_cache, k=None, v=None,
            cache_seqlens=meta.seq_lens, page_table=meta.block_tables,
            softmax_scale=scale, causal=True, window_size=window_size_for(sliding_window),
            softcap=float(softcap), **chunk, **extra,
        )

    if _is_decode(meta, total):
        out = _unwrap(call(q[:total].reshape(total, 1, Hq, D))).reshape(total, Hq, -1)
    elif varlen:
        out = _unwrap(call(q[:total], cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len))
    else:
        out = _call_padded(q, meta, total, call)
    return _finish(out, total, q, Dv)


class _FlashAttnBackend:
    """Shared lazy resolution / availability logic; subclasses fill in the specifics."""

    name = ""
    priority = 0
    # decode steps read only the metadata tensors and its static host fields: CUDA-Graph capturable
    cuda_graph_safe = True
    block_size_multiple = 1
    _modules: tuple[tuple[str, str], ...] = ()  # (module, attribute) candidates, tried in order
    _required_kwargs: tuple[str, ...] = ()

    def __init__(self, fn: FlashFn | None = None) -> None:
        self._fn: FlashFn | None = fn
        self._resolved = fn is not None

    # -- library resolution -------------------------------------------------------------
    def _resolve(self) -> FlashFn | None:
        if not self._resolved:
            self._resolved = True
            for mod_name, attr in self._modules:
                try:
                    fn = getattr(importlib.import_module(mod_name), attr)
                except Exception:  # ImportError, or a broken CUDA extension
                    continue
                if _accepts(fn, *self._required_kwargs):
                    self._fn = fn
                    break
        return self._fn

    def _library(self) -> FlashFn:
        fn = self._resolve()
        if fn is None:
            raise RuntimeError(
                f"attention backend {self.name!r}: {' / '.join(m for m, _ in self._modules)} is not importable "
                f"(or lacks {', '.join(self._required_kwargs)})"
            )
        return fn

    def _capability_ok(self, major: int, minor: int) -> bool:
        raise NotImplementedError

    def _takes_alibi(self) -> bool:
        """Whether the library call applies ALiBi slopes (FA2: ``alibi_slopes``; FA3 has none)."""
        return False

    def _takes_chunk(self) -> bool:
        """Whether the library call serves chunked attention (FA3: ``attention_chunk``; FA2 has none)."""
        return False

    def _build_usable(self) -> bool:
        return True

    # -- AttentionBackend -----------------------------------------------------------------
    def is_available(self, device: torch.device) -> bool:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        try:
            major, minor = torch.cuda.get_device_capability(device)
        except Exception:
            return False
        if not self._capability_ok(major, minor):
            return False
        return self._resolve() is not None and self._build_usable()

    def supports(self, *, dtype: torch.dtype, head_dim: int, softcap: float, sliding_window: int,
                 block_size: int | None = None, alibi: bool = False, sinks: bool = False,
                 attention_chunk: int = -1) -> bool:
        if (alibi and not self._takes_alibi()) or sinks or (attention_chunk > 0 and not self._takes_chunk()):
            return False
        if dtype not in _HALF_DTYPES or head_dim > _MAX_HEAD_DIM:
            return False
        if block_size is not None and block_size % self.block_size_multiple:
            return False
        return True


class FlashAttn2Backend(_FlashAttnBackend):
    """FlashAttention-2 ``flash_attn_with_kvcache(..., block_table=...)``; block_size % 256 == 0."""

    name = "flash_attn2"
    priority = 30
    block_size_multiple = FA2_BLOCK_SIZE_MULTIPLE
    _modules = (("flash_attn", "flash_attn_with_kvcache"),)
    _required_kwargs = ("cache_seqlens", "block_table", "softmax_scale", "causal", "window_size", "softcap")

    def _capability_ok(self, major: int, minor: int) -> bool:
        return (major, minor) >= (8, 0)

    def _takes_alibi(self) -> bool:
        fn = self._resolve()
        return fn is not None and _accepts(fn, "alibi_slopes")

    def forward(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, alibi_slopes=None):
        return fa2_forward(q, k, v, k_cache, v_cache, meta, scale=scale, softcap=softcap,
                           sliding_window=sliding_window, fn=self._library(), alibi_slopes=alibi_slopes)


class FlashAttn3Backend(_FlashAttnBackend):
    """FlashAttention-3 (Hopper) ``flash_attn_with_kvcache(..., page_table=..., cu_seqlens_q=...)``."""

    name = "flash_attn3"
    priority = 40
    _modules = (("flash_attn_interface", "flash_attn_with_kvcache"),
                ("flash_attn_3.flash_attn_interface", "flash_attn_with_kvcache"))
    _required_kwargs = ("cache_seqlens", "page_table", "softmax_scale", "causal", "window_size", "softcap")

    def _capability_ok(self, major: int, minor: int) -> bool:
        return major == 9

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def _build_flags() -> dict:
        """FA3's ``flash_attn_config.CONFIG['build_flags']`` when installed, else {} (cached)."""
        try:
            cfg = importlib.import_module("flash_attn_config").CONFIG
            return dict(cfg.get("build_flags", {}))
        except Exception:
            return {}

    def _build_usable(self) -> bool:
        flags = self._build_flags()
        # cache_seqlens (seqused_k) is a varlen feature; the cache is paged.
        return not (flags.get("FLASHATTENTION_DISABLE_PAGEDKV") or flags.get("FLASHATTENTION_DISABLE_VARLEN"))

    def _takes_chunk(self) -> bool:
        fn = self._resolve()
        return fn is not None and _accepts(fn, "attention_chunk")

    def supports(self, *, dtype: torch.dtype, head_dim: int, softcap: float, sliding_window: int,
                 block_size: int | None = None, alibi: bool = False, sinks: bool = False,
                 attention_chunk: int = -1) -> bool:
        if not super().supports(dtype=dtype, head_dim=head_dim, softcap=softcap, sliding_window=sliding_window,
                                block_size=block_size, alibi=alibi, sinks=sinks, attention_chunk=attention_chunk):
            return False
        if head_dim % 8:  # "head_size should be a multiple of 8" (hopper/flash_api.cpp)
            return False
        flags = self._build_flags()
        if softcap > 0 and flags.get("FLASHATTENTION_DISABLE_SOFTCAP"):
            return False
        if (sliding_window > 0 or attention_chunk > 0) and flags.get("FLASHATTENTION_DISABLE_LOCAL"):
            return False
        if dtype == torch.float16 and flags.get("FLASHATTENTION_DISABLE_FP16"):
            return False
        return True

    def forward(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, attention_chunk=-1):
        return fa3_forward(q, k, v, k_cache, v_cache, meta, scale=scale, softcap=softcap,
                           sliding_window=sliding_window, fn=self._library(), attention_chunk=attention_chunk)


register_backend(FlashAttn3Backend())
register_backend(FlashAttn2Backend())
