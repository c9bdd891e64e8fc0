"""``devin::kv_prune``: fold one layer's attention scores into KV pruning's accumulators.

Schema::

    devin::kv_prune(Tensor q, Tensor attn_out, int layer, float scale, float softcap=0.) -> ()

Inserted by ``insert_kv_prune`` after each ``devin::paged_attention`` of the decode graph,
with that call's ``q`` [T, Hq, D] and its output (which orders it after the attention, so
this step's K/V are in the cache). It reads ``StepContext.kv_prune`` (a
:class:`~devin_compile.runtime.kv_prune.PruneStep`); when no sequence prunes this step that
is None and the op returns at once. Otherwise it takes the attention-mass side output the
backend left for this layer, or, for backends without one, recomputes the mass of the
sequences evaluating this step, and accumulates it (normalisation: see runtime/kv_prune/scores.py).
Eviction and compaction run after the forward (they need every layer's scores).
Side-effecting (registered with ``torch.fx.node.has_side_effect``): never dead code.
"""
from __future__ import annotations

import torch
import torch.fx

from ..step import current_context

_lib = torch.library.Library("devin", "FRAGMENT")
_lib.define("kv_prune(Tensor q, Tensor attn_out, int layer, float scale, float softcap=0.) -> ()")


def kv_prune(q: torch.Tensor, attn_out: torch.Tensor, layer: int, scale: float, softcap: float = 0.0) -> None:
    ctx = current_context()
    step = ctx.kv_prune
    if step is None or not step.score_rows:
        return
    k_cache, _ = ctx.kv_cache.layer(layer)
    group = q.shape[1] // k_cache.shape[2]
    if step.phase == "prefill":
        from ..backends.attention.attention_scores import window_scores

        for b, seq in step.score_rows:
            w = seq.kv_prune_state.config.prefill_window
            step.accumulate_window(layer, b, seq, *window_scores(q, k_cache, ctx.attn, b, w, scale=scale,
                                                                 softcap=softcap))
        return
    side = step.side.pop(layer, None)
    if side is not None:
        step.accumulate(layer, side, group)
        return
    rows = [b for b, seq in step.eval_rows if seq.kv_prune_state.config.policy == "attention"]
    if not rows:
        return
    from ..backends.attention.attention_scores import recompute_decode_mass

    mass = recompute_decode_mass(q, k_cache, ctx.attn, rows, scale=scale, softcap=softcap)
    step.accumulate(layer, mass, group)


_lib.impl("kv_prune", kv_prune, "CompositeExplicitAutograd")


@torch.library.register_fake("devin::kv_prune", lib=_lib)
def _(q, attn_out, layer, scale, softcap=0.0):
    return None


torch.fx.node.has_side_effect(torch.ops.devin.kv_prune.default)
