"""``devin::paged_attention``: write this step's K/V into the paged cache and attend.

Schema::

    devin::paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale,
                           float softcap=0., int sliding_window=-1, Tensor? alibi_slopes=None,
                           Tensor? sinks=None, int attention_chunk=-1) -> Tensor

q: [T, Hq, D], k/v: [T, Hkv, D] for the T packed tokens of one step; returns
[T, Hq, Dv]. ``alibi_slopes`` [Hq] (float32; ALiBi families) adds
``slope_h · (key_pos − query_pos)`` to every score, positions being cache slots (equal to
token positions: KV pruning, which breaks that, is refused for ALiBi models). ``sinks`` [Hq]
(float32; gpt-oss) is a learned per-head logit that joins each softmax's denominator and
attends to nothing: ``p_j = exp(s_j) / (exp(sink_h) + Σ_k exp(s_k))``. ``attention_chunk``
C > 0 (Llama 4's local layers) lets the query at position p see only the keys of its own
chunk, slots ``floor(p / C)·C .. p``. The cache, block tables, slot mapping and sequence
lengths come from the per-step context (:mod:`devin_compile.step`), never from the graph. The
backend is the one the runtime installed in the context for this step; calls it
declines (see ``AttentionBackend.supports``) run on the torch reference.

Defined with ``torch.library.Library`` + a ``CompositeExplicitAutograd`` kernel rather
than ``torch.library.custom_op``: the op runs 30+ times per decode step and the
lighter registration halves its dispatch cost. Inference only (no autograd formula).
"""
from __future__ import annotations

import torch

from ..step import current_context

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, "
            "float softcap=0., int sliding_window=-1, Tensor? alibi_slopes=None, Tensor? sinks=None, "
            "int attention_chunk=-1) -> Tensor")


def _extras(alibi_slopes, sinks, attention_chunk: int) -> tuple[dict, dict]:
    """(``supports`` keywords, ``forward`` keywords) for the per-head terms and the chunk this call has:
    each is passed only when present, so backends that do not know a keyword keep working."""
    ask, give = {}, {}
    if alibi_slopes is not None:
        ask["alibi"], give["alibi_slopes"] = True, alibi_slopes
    if sinks is not None:
        ask["sinks"], give["sinks"] = True, sinks
    if attention_chunk > 0:
        ask["attention_chunk"] = give["attention_chunk"] = int(attention_chunk)
    return ask, give


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                    softcap: float = 0.0, sliding_window: int = -1,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    attention_chunk: int = -1) -> torch.Tensor:
    ctx = current_context()
    k_cache, v_cache = ctx.kv_cache.layer(layer)
    backend = ctx.backend
    ask, give = _extras(alibi_slopes, sinks, attention_chunk)
    if not backend.supports(dtype=q.dtype, head_dim=q.shape[-1], softcap=softcap, sliding_window=sliding_window,
                            block_size=k_cache.shape[1], **ask):
        from ..backends.attention.registry import get_backend

        backend = get_backend("torch_reference")
    if give:
        if ctx.kv_prune is not None:
            raise RuntimeError(f"devin::paged_attention: KV pruning does not serve calls with {', '.join(give)} "
                               "(compacted slots stop being positions; no attention mass is kept for them); "
                               "drop kv_prune= for this model")
        return backend.forward(q, k, v, k_cache, v_cache, ctx.attn, scale=scale, softcap=softcap,
                               sliding_window=sliding_window, **give)
    step = ctx.kv_prune
    if step is not None and step.side_output and hasattr(backend, "forward_with_scores"):
        # KV pruning: the attention mass per cached slot as a side output (ops/kv_prune.py consumes it)
        out, step.side[layer] = backend.forward_with_scores(
            q, k, v, k_cache, v_cache, ctx.attn, scale=scale, softcap=softcap, sliding_window=sliding_window,
            rows=step.score_row_ids)
        return out
    return backend.forward(q, k, v, k_cache, v_cache, ctx.attn, scale=scale, softcap=softcap,
                           sliding_window=sliding_window)


_lib.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::paged_attention", lib=_lib)
def _(q, k, v, layer, scale, softcap=0.0, sliding_window=-1, alibi_slopes=None, sinks=None, attention_chunk=-1):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
