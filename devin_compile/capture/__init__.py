"""Capture: a Hugging Face causal LM → an FX GraphModule over flattened tokens.

The captured graph has three inputs and one output::

    input_ids       [1, T]  int64   several sequences packed end to end, no padding
    position_ids    [1, T]  int64   each token's position within its own sequence
    logits_indices  [N]     int64   which of the T positions need logits (e.g. last of each seq)
    → logits        [1, N, vocab]

T and N are dynamic. Capture uses ``torch.export`` (non-strict) on the model's own
forward with ``logits_to_keep=logits_indices``, so model-specific heads (soft-capping,
scaling) stay exactly as Hugging Face wrote them. A construct that cannot be captured
raises :class:`UnsupportedModelError` naming the module and construct; there is no
silent fallback to eager.

:func:`model_info` reads the facts the runtime needs structurally, not by model name:

- attention modules: modules whose class name ends in ``Attention`` and that have a
  ``layer_idx`` (``layers.0.self_attn``, ``h.0.attn``, ``layers.0.attention`` alike);
  passes find a node's layer through them (:func:`module_path_of` with ``among=``);
- KV heads: what the attention modules use (``num_key_value_heads`` / ``num_kv_heads`` /
  ``num_key_value_groups``) when they agree, else the config (Falcon's multi-query
  attention runs one KV head whatever ``config.num_kv_heads`` says);
- sliding windows and attention chunks: observed from the masks HF builds in a short probe
  forward (see :func:`.mask_probe.mask_shapes`), since some families keep the window only in
  the config, and Llama 4 chunks only some layers.
- steps: a model whose graph holds only up to B tokens a step (a branch on the token count, e.g.
  XGLM's sinusoidal table) records ``max_step_tokens = B`` (see :func:`.export.capture`);
- causality: encoder attention (``is_causal=False`` modules, e.g. BERT with
  ``is_decoder=False``, or a mask that lets every token see every other) is refused, not
  served as causal.
"""
from __future__ import annotations

from .errors import UnsupportedModelError
from .export import FlatTokensLM, capture, module_path_of
from .model_info import ModelInfo, model_info

__all__ = ["FlatTokensLM", "ModelInfo", "UnsupportedModelError", "capture", "model_info", "module_path_of"]
