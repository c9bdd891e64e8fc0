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
- sliding windows: observed from the masks HF builds in a short probe forward (see
  :func:`_sliding_windows`), since some families keep the window only in the config.
- causality: encoder attention (``is_causal=False`` modules, e.g. BERT with
  ``is_decoder=False``, or a mask that lets every token see every other) is refused, not
  served as causal.
"""
from __future__ import annotations

import inspect
import re
import traceback
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.fx

from .compile_lock import TRACE_LOCK


class UnsupportedModelError(RuntimeError):
    """The model cannot be compiled; the message names the construct and a way out."""


@dataclass
class ModelInfo:
    """Facts about the captured model that passes and the runtime need."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: list[int]
    attention_modules: list[str] = field(default_factory=list)  # graph-qualified names, in layer order
    sliding_windows: dict[str, int] = field(default_factory=dict)  # attention module → window (if any)


class FlatTokensLM(torch.nn.Module):
    """Wraps an HF causal LM into the flattened-token signature the compiler captures."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor):
        out = self.m(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_indices,
                     use_cache=False, return_dict=True)
        return out.logits


def _eos_ids(model) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is None:
            continue
        ids.extend(e if isinstance(e, (list, tuple)) else [e])
    return sorted(set(int(i) for i in ids))


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Decoder attention modules in layer order (class name ending in 'Attention')."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def _module_kv_heads(attn: list[tuple[str, torch.nn.Module]], heads: int) -> int | None:
    """KV heads as the attention modules themselves use them, when they say so.

    The config can disagree with the module: Falcon's multi-query attention keeps
    ``config.num_kv_heads == num_attention_heads`` but runs with one KV head. Modules
    expose ``num_key_value_heads`` / ``num_kv_heads`` or ``num_key_value_groups``
    (query heads per KV head); if all layers agree on one value, it wins over the config.
    """
    found = set()
    for _n, m in attn:
        for name in ("num_key_value_heads", "num_kv_heads"):
            v = getattr(m, name, None)
            if isinstance(v, int) and v > 0:
                found.add(v)
                break
        else:
            g = getattr(m, "num_key_value_groups", None)
            if isinstance(g, int) and g > 0 and heads % g == 0:
                found.add(heads // g)
    return found.pop() if len(found) == 1 else None


def model_info(model: torch.nn.Module) -> ModelInfo:
    """Read the facts the compiler needs from an HF model, or say why it is unsupported."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "forward"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Hugging Face PreTrainedModel (no .config); "
            "pass an AutoModelForCausalLM model"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; devin-compile compiles decoder-only causal LMs"
        )
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward has no `logits_to_keep` argument, so it is not a "
            "causal-LM head model; load it with AutoModelForCausalLM"
        )
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    needed = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
    missing = [k for k in needed if getattr(text_cfg, k, None) is None]
    if missing:
        raise UnsupportedModelError(f"{type(model).__name__}'s config lacks {missing}; not a decoder LM config")
    heads = text_cfg.num_attention_heads
    attn = _attention_modules(model)
    kv_heads = _module_kv_heads(attn, heads) or getattr(text_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
    param = next(model.parameters())
    return ModelInfo(
        model_type=getattr(cfg, "model_type", type(model).__name__),
        num_layers=text_cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=text_cfg.vocab_size,
        max_model_len=int(getattr(text_cfg, "max_position_embeddings", 0) or 2048),
        dtype=param.dtype,
        device=param.device,
        eos_token_ids=_eos_ids(model),
        attention_modules=["m." + n for n, _ in attn],
        sliding_windows={"m." + n: w for n, w in _sliding_windows(model, text_cfg, attn).items()},
    )


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


def _sliding_windows(model: torch.nn.Module, text_cfg, attn: list[tuple[str, torch.nn.Module]]) -> dict[str, int]:
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
        if torch.equal(vis, causal):
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


def _culprit(exc: BaseException) -> str:
    """The innermost transformers frame of a failure: which module, which line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "transformers" in fr.filename or "/models/" in fr.filename:
            return f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} in {fr.name}: {fr.line}"
    fr = frames[-1] if frames else None
    return f"{fr.filename}:{fr.lineno} in {fr.name}" if fr else "unknown location"


def capture(model: torch.nn.Module, *, example_len: int = 8, info: ModelInfo | None = None,
            stack_traces: bool = False) -> tuple[torch.fx.GraphModule, ModelInfo]:
    """Export ``model`` over flattened tokens; returns the GraphModule and :class:`ModelInfo`
    (``info`` from an earlier :func:`model_info` call is reused, with dtype/device refreshed).

    ``stack_traces=True`` keeps each node's Python stack trace in ``meta['stack_trace']`` (for
    dumps); recording them costs about a third of the export time, so it is off by default."""
    if info is None:
        info = model_info(model)
    else:
        param = next(model.parameters())
        info.dtype, info.device = param.dtype, param.device
    model.eval()
    device = info.device
    T = torch.export.Dim("num_tokens", min=2)
    N = torch.export.Dim("num_logits", min=1)
    ids = torch.randint(0, min(info.vocab_size, 100), (1, example_len), device=device)
    pos = torch.arange(example_len, device=device)[None]
    idx = torch.arange(example_len, device=device)
    emit_before = getattr(torch.fx.config, "do_not_emit_stack_traces", None)  # None: this torch has no switch
    if emit_before is not None:
        torch.fx.config.do_not_emit_stack_traces = not stack_traces
    try:
        with TRACE_LOCK, torch.no_grad():
            ep = torch.export.export(
                FlatTokensLM(model), (ids, pos, idx),
                dynamic_shapes=({1: T}, {1: T}, {0: N}), strict=False,
            )
    except Exception as e:  # noqa: BLE001  (any capture failure becomes one clear error)
        msg = str(e).strip().splitlines()
        first = msg[0] if msg else type(e).__name__
        raise UnsupportedModelError(
            f"could not capture {type(model).__name__} ({info.model_type}) with torch.export: "
            f"{type(e).__name__}: {first}\n  at {_culprit(e)}\n"
            "Way out: load the model with attn_implementation='sdpa' or 'eager', make sure it runs "
            "with use_cache=False on position_ids alone, or file the construct as unsupported."
        ) from e
    finally:
        if emit_before is not None:
            torch.fx.config.do_not_emit_stack_traces = emit_before
    gm = ep.module()
    _strip_export_guards(gm)
    return gm, info


def _strip_export_guards(gm: torch.fx.GraphModule) -> None:
    """Drop ``_guards_fn`` (export's input-shape guard module): the runtime owns input checks."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()


def module_path_of(node: torch.fx.Node, pattern: str = r"\.layers\.\d+\.[A-Za-z_]*attn[A-Za-z_]*$",
                   among: "set[str] | list[str] | None" = None) -> str | None:
    """The innermost module (from export's nn_module_stack) whose path is in ``among`` (when
    given, e.g. ``ModelInfo.attention_modules``; this works whatever the layers are called:
    ``h.0.attn``, ``layers.0.attention``) or else matches ``pattern``."""
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    wanted = set(among) if among is not None else None
    for path, _cls in stack.values():
        path = path.replace("L['self'].", "").replace("L__self__.", "")
        if (path in wanted) if wanted is not None else re.search(pattern, path):
            found = path
    return found
