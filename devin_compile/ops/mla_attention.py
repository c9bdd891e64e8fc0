"""``devin::mla_attention``: multi-head latent attention over the paged latent cache.

Schema::

    devin::mla_attention(Tensor q_nope, Tensor q_rope, Tensor latent, Tensor k_rope, Tensor w_kv_b,
                         int layer, float scale) -> Tensor

q_nope [T, H, dn], q_rope [T, H, dr]: the query's no-position and rotary parts; latent [T, R]
(after ``kv_a_layernorm``) and k_rope [T, dr] (after rotary): what the cache stores for each
new token; w_kv_b [H·(dn+dv), R]: ``kv_b_proj``'s weight (a graph constant). Returns [T, H, dv].
The layer's cache (``PagedKVCache.layer(layer)[0]``, [blocks, block_size, 1, R+dr]), block tables
and slots come from the step context. Decode rows use the absorbed form, prefill rows expand
K/V from the latents (:mod:`devin_compile.backends.attention.mla`); one torch implementation
serves every device.
"""
from __future__ import annotations

import torch

from ..backends.attention.mla import mla_forward
from ..step import current_context

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("mla_attention(Tensor q_nope, Tensor q_rope, Tensor latent, Tensor k_rope, Tensor w_kv_b, "
            "int layer, float scale) -> Tensor")


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  w_kv_b: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    ctx = current_context()
    cache, _ = ctx.kv_cache.layer(layer)
    R = w_kv_b.shape[-1]
    if cache.shape[-1] != R + k_rope.shape[-1] or cache.shape[-2] != 1:
        raise RuntimeError(
            f"devin::mla_attention: layer {layer}'s cache rows hold {cache.shape[-2]}x{cache.shape[-1]} values, "
            f"expected one latent row of kv_lora_rank + qk_rope_head_dim = {R + k_rope.shape[-1]} "
            "(build the KV cache with ModelInfo.kv_cache_layout)")
    if ctx.kv_prune is not None:
        raise RuntimeError("devin::mla_attention: KV pruning is unsupported for multi-head latent attention")
    return mla_forward(q_nope, q_rope, latent, k_rope, cache, ctx.attn, w_kv_b, scale)


_lib.impl("mla_attention", mla_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::mla_attention", lib=_lib)
def _(q_nope, q_rope, latent, k_rope, w_kv_b, layer, scale):
    H = q_nope.shape[1]
    return q_nope.new_empty((q_nope.shape[0], H, w_kv_b.shape[0] // H - q_nope.shape[2]))
