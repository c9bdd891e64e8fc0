"""Probe the masks HF builds: sliding windows and causality, read from one short forward.

Some families keep the sliding window only in the config, and some attention modules are
bidirectional (encoder) attention behind a causal-LM head; both show in the mask HF hands
each attention module, which one probe forward records.
"""
from __future__ import annotations

import inspect
from typing import NoReturn

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


def sliding_windows(model: torch.nn.Module, text_cfg, attn: list[tuple[str, torch.nn.Module]]) -> dict[str, int]:
    """Each attention module's sliding window (-1: full causal), read from the mask HF builds.

    Where the window lives differs by family: some attention modules carry
    ``sliding_window`` (Gemma 2/3, Qwen2, Cohere2, ...), others (Mistral, Mixtral, Phi-3,
    Starcoder2) only have ``config.sliding_window`` and apply it through the mask. So we
    observe the mask instead: one short forward (``_PROBE_LEN`` tokens) with the config's
    mask widths temporarily shrunk (``sliding_window`` → ``_PROBE_WINDOW``,
    ``attention_chunk_size`` → ``_PROBE_CHUNK``), recording each attention module's
    ``attention_mask`` argument. A layer whose mask is the plain causal one (or None, SDPA's
    is_causal shortcut) is full attention, unless the module's own ``sliding_window``
    attribute names a window too wide for the probe to see; a layer whose mask is the
    causal band of width ``_PROBE_WINDOW`` uses ``config.sliding_window``; any other mask
    (chunked attention, bidirectional prefixes, ALiBi biases folded into the mask, ...)
    raises :class:`UnsupportedModelError`. If the probe cannot run or a mask is not a plain
    [q, kv] tensor, the modules' ``sliding_window`` attributes are used. Encoder attention
    (an all-visible mask; else, with no mask to read, ``is_causal=False`` in the call or on
    the module) raises :func:`_refuse_bidirectional`'s error.
    """
    fallback = _attribute_windows(attn)
    if not attn:
        return fallback
    def _width(name: str) -> int | None:
        v = getattr(text_cfg, name, None)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    window = _width("sliding_window")
    has_window = window is not None
    shrink = {name: probe for name, probe in (("sliding_window", _PROBE_WINDOW), ("attention_chunk_size", _PROBE_CHUNK))
              if _width(name) is not None}
    saved = {name: getattr(text_cfg, name) for name in shrink}
    masks: dict[str, object] = {}
    causal_flags: dict[str, object] = {}  # an explicit is_causal= argument, if the call passed one
    hooks = []

    def recorder(name: str, module: torch.nn.Module):
        sig = inspect.signature(module.forward)

        def hook(_mod, args, kwargs):
            try:
                bound = sig.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = kwargs
            masks.setdefault(name, bound.get("attention_mask", _MISSING))
            causal_flags.setdefault(name, bound.get("is_causal", kwargs.get("is_causal")))

        return hook

    param = next(model.parameters())
    L = _PROBE_LEN
    ids = (torch.arange(L, device=param.device) % max(1, text_cfg.vocab_size))[None]
    was_training = model.training
    try:
        for n, m in attn:
            hooks.append(m.register_forward_pre_hook(recorder(n, m), with_kwargs=True))
        for name, probe in shrink.items():
            setattr(text_cfg, name, probe)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.arange(L, device=param.device)[None], use_cache=False)
    except Exception:  # noqa: BLE001  (capture will report the real problem, if any)
        masks.clear()  # nothing observed: the modules' attributes decide below
    finally:
        for h in hooks:
            h.remove()
        for name, value in saved.items():
            setattr(text_cfg, name, value)
        model.train(was_training)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    band = causal & ~torch.ones(L, L, dtype=torch.bool).tril(-_PROBE_WINDOW)
    out: dict[str, int] = {}
    for n, m in attn:
        mask = masks.get(n, _MISSING)
        vis = _visible(mask) if isinstance(mask, torch.Tensor) else None
        if vis is None or tuple(vis.shape) != (L, L):
            # No mask to read (None: SDPA / flash attention follow is_causal, HF's default True), so the
            # call's is_causal= or the module's is_causal decides (False: e.g. BERT with is_decoder=False).
            flag = causal_flags.get(n)
            if (flag if flag is not None else getattr(m, "is_causal", True)) is False:
                _refuse_bidirectional(model, n)
            out[n] = -1 if mask is None else fallback[n]
            continue
        vis = vis.cpu()
        if torch.equal(vis, causal) or torch.equal(vis, ~causal):
            # ~causal: a bool mask marking the *hidden* keys (MPT's masked_fill(mask, min) convention)
            out[n] = fallback[n] if fallback[n] >= L else -1
        elif has_window and torch.equal(vis, band):
            out[n] = int(window)
        elif bool(vis.all()):
            _refuse_bidirectional(model, n)
        else:
            raise UnsupportedModelError(
                f"{n}: the attention mask {type(model).__name__} builds is neither causal nor a causal "
                "sliding window (e.g. chunked or bidirectional attention, or ALiBi biases folded into the "
                "mask); the paged runtime serves only causal and sliding-window attention"
            )
    return out
