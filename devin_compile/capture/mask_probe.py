"""Probe the masks HF builds: sliding windows, attention chunks and causality, read from one short forward.

Some families keep the sliding window only in the config, some restrict a layer to chunks (Llama 4's
local layers), and some attention modules are bidirectional (encoder) attention behind a causal-LM
head; all of it shows in the mask HF hands each attention module, which one probe forward records.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple, NoReturn

import torch

from .errors import UnsupportedModelError


def _refuse_bidirectional(model: torch.nn.Module, where: str) -> NoReturn:
    """Raise for encoder attention, which capture would otherwise serve as if it were causal."""
    raise UnsupportedModelError(
        f"{where}: {type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r}) uses "
        "bidirectional (encoder) attention, which is not causal: each token also attends to the tokens after "
        "it, and the paged runtime serves only causal attention. devin-compile compiles causal LMs: load a "
        "decoder-only model with AutoModelForCausalLM (a BERT-style model needs config.is_decoder=True)"
    )


_MISSING = object()
_PROBE_LEN = 6
_PROBE_WINDOW = 2
_PROBE_CHUNK = 3


class MaskShape(NamedTuple):
    """What one attention module's mask hides besides the future: a window and/or a chunk (-1: none)."""

    window: int = -1
    chunk: int = -1


def _attribute_windows(attn: list[tuple[str, torch.nn.Module]]) -> dict[str, int]:
    return {n: int(getattr(m, "sliding_window", None) or -1) for n, m in attn}


def _visible(mask: torch.Tensor) -> torch.Tensor | None:
    """[q, kv] bool 'query sees key' from an HF 4D mask (bool, or additive float with min for masked)."""
    if mask.dim() == 4:
        mask = mask[0, 0]
    if mask.dim() != 2:
        return None
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask > torch.finfo(mask.dtype).min / 2
    return None


def mask_shapes(model: torch.nn.Module, text_cfg, attn: list[tuple[str, torch.nn.Module]]) -> dict[str, MaskShape]:
    """Each attention module's sliding window and attention chunk (-1: none), read from the mask HF builds.

    Where the window lives differs by family: some attention modules carry
    ``sliding_window`` (Gemma 2/3, Qwen2, Cohere2, ...), others (Mistral, Mixtral, Phi-3,
    Starcoder2) only have ``config.sliding_window`` and apply it through the mask. So we
    observe the mask instead: one short forward (``_PROBE_LEN`` tokens) with the config's
    mask widths temporarily shrunk (``sliding_window`` → ``_PROBE_WINDOW``,
    ``attention_chunk_size`` → ``_PROBE_CHUNK``), recording each attention module's
    ``attention_mask`` argument. A layer whose mask is the plain causal one (or None, SDPA's
    is_causal shortcut) is full attention, unless the module's own ``sliding_window``
    attribute names a window too wide for the probe to see; a layer whose mask is the
    causal band of width ``_PROBE_WINDOW`` uses ``config.sliding_window``; a layer whose mask
    is causal within chunks of ``_PROBE_CHUNK`` (query i sees keys ``floor(i / 3)·3 .. i``) uses
    ``config.attention_chunk_size``; any other mask (bidirectional prefixes, ALiBi biases folded
    into the mask, ...) raises :class:`UnsupportedModelError`. If the probe cannot run or a mask is not a plain
    [q, kv] tensor, the modules' ``sliding_window`` attributes are used. Encoder attention
    (an all-visible mask; else, with no mask to read, ``is_causal=False`` in the call or on
    the module) raises :func:`_refuse_bidirectional`'s error.
    """
    fallback = _attribute_windows(attn)
    if not attn:
        return {}
    widths = MaskShape(_config_width(text_cfg, "sliding_window") or -1, _config_width(text_cfg, "attention_chunk_size") or -1)
    masks, causal_flags = _probe_masks(model, text_cfg, attn)
    return {n: _shape_of(model, n, m, masks.get(n, _MISSING), causal_flags.get(n), fallback[n], widths)
            for n, m in attn}


def _config_width(text_cfg, name: str) -> int | None:
    """The config's positive integer ``name`` (a mask width), else None."""
    v = getattr(text_cfg, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _probe_masks(model: torch.nn.Module, text_cfg,
                 attn: list[tuple[str, torch.nn.Module]]) -> tuple[dict[str, object], dict[str, object]]:
    """Each attention module's ``attention_mask`` and explicit ``is_causal`` arguments in one
    ``_PROBE_LEN``-token forward with the config's mask widths shrunk to the probe's (config and
    train mode put back after); no masks when the forward fails."""
    shrink = {name: probe for name, probe in (("sliding_window", _PROBE_WINDOW), ("attention_chunk_size", _PROBE_CHUNK))
              if _config_width(text_cfg, name) is not None}
    saved = {name: getattr(text_cfg, name) for name in shrink}
    masks: dict[str, object] = {}
    causal_flags: dict[str, object] = {}  # an explicit is_causal= argument, if the call passed one
    hooks = []
    param = next(model.parameters())
    L = _PROBE_LEN
    ids = (torch.arange(L, device=param.device) % max(1, text_cfg.vocab_size))[None]
    was_training = model.training
    try:
        for n, m in attn:
            hooks.append(m.register_forward_pre_hook(_recorder(n, m, masks, causal_flags), with_kwargs=True))
        for name, probe in shrink.items():
            setattr(text_cfg, name, probe)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(L, device=param.device)[None], use_cache=False)
    except Exception:  # noqa: BLE001  (capture will report the real problem, if any)
        masks.clear()  # nothing observed: the modules' attributes decide
    finally:
        for h in hooks:
            h.remove()
        for name, value in saved.items():
            setattr(text_cfg, name, value)
        model.train(was_training)
    return masks, causal_flags


def _recorder(name: str, module: torch.nn.Module, masks: dict[str, object], causal_flags: dict[str, object]):
    """A forward pre-hook recording the first ``attention_mask`` and ``is_causal`` ``module`` gets."""
    sig = inspect.signature(module.forward)

    def hook(_mod, args, kwargs):
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        masks.setdefault(name, bound.get("attention_mask", _MISSING))
        causal_flags.setdefault(name, bound.get("is_causal", kwargs.get("is_causal")))

    return hook


def _shape_of(model: torch.nn.Module, name: str, module: torch.nn.Module, mask: object, causal_flag: object,
              attribute_window: int, widths: MaskShape) -> MaskShape:
    """One attention module's window and chunk from the mask it got in the probe (see :func:`mask_shapes`)."""
    L = _PROBE_LEN
    vis = _visible(mask) if isinstance(mask, torch.Tensor) else None
    if vis is None or tuple(vis.shape) != (L, L):
        # No mask to read (None: SDPA / flash attention follow is_causal, HF's default True), so the
        # call's is_causal= or the module's is_causal decides (False: e.g. BERT with is_decoder=False).
        if (causal_flag if causal_flag is not None else getattr(module, "is_causal", True)) is False:
            _refuse_bidirectional(model, name)
        return MaskShape(-1 if mask is None else attribute_window)
    vis = vis.cpu()
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    causal = j <= i
    if torch.equal(vis, causal) or torch.equal(vis, ~causal):
        # ~causal: a bool mask marking the *hidden* keys (MPT's masked_fill(mask, min) convention)
        return MaskShape(attribute_window if attribute_window >= L else -1)
    if widths.window > 0 and torch.equal(vis, causal & (j > i - _PROBE_WINDOW)):
        return MaskShape(window=widths.window)
    if widths.chunk > 0 and torch.equal(vis, causal & (j >= i // _PROBE_CHUNK * _PROBE_CHUNK)):
        return MaskShape(chunk=widths.chunk)
    if bool(vis.all()):
        _refuse_bidirectional(model, name)
    raise UnsupportedModelError(
        f"{name}: the attention mask {type(model).__name__} builds is neither causal, nor a causal "
        "sliding window, nor causal within fixed chunks (e.g. bidirectional attention, or ALiBi biases "
        "folded into the mask); the paged runtime serves only those"
    )
