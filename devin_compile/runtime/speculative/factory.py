"""Building speculative proposers for ``optimize(speculative=...)`` and ``OptimizedModel.set_draft``.

- ``ngram``: :class:`~devin_compile.runtime.speculative.NgramProposer`, no model.
- ``draft``: the given HF causal LM compiled with ``optimize()`` (``draft_options``; the target's
  dtype unless they say otherwise), or ``"self-int4"``: the target itself compiled again with RTN
  INT4 weights (group 64, the lm_head too). Its vocabulary must be the target's (``ValueError`` otherwise).
- ``head``: :func:`layer_view` of the target — its first ``layers`` decoder layers (and last
  ``last_layers``), embedding, final norm and lm_head, the very same modules (no weight copy) —
  compiled with ``optimize()`` like a draft.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch

from ...config import SpeculativeConfig
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .proposer import Proposer


def layer_view(model: torch.nn.Module, keep: list[int]) -> torch.nn.Module:
    """A model object that runs only decoder layers ``keep`` of ``model``, sharing every module
    (embedding, the kept layers, norm, lm_head) with it. Modules on the path to the layer list are
    shallow copies with their own child tables; the config is a copy with ``num_hidden_layers``
    (and per-layer lists such as ``layer_types``) cut down to ``keep``."""
    n = model.config.num_hidden_layers
    path = next((name for name, m in model.named_modules()
                 if isinstance(m, torch.nn.ModuleList) and len(m) == n), None)
    if path is None:
        raise ValueError(f"speculative head: found no list of {n} decoder layers in {type(model).__name__}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = len(keep)
    for key, value in list(vars(cfg).items()):
        if isinstance(value, list) and len(value) == n and key != "architectures":
            setattr(cfg, key, [value[i] for i in keep])
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parts = path.split(".")
    cur = root
    for name in parts[:-1]:
        child = copy.copy(cur._modules[name])
        child._modules = dict(child._modules)
        cur._modules[name] = child
        cur = child
    layers = cur._modules[parts[-1]]
    cur._modules[parts[-1]] = torch.nn.ModuleList([layers[i] for i in keep])
    for m in [root] + [root.get_submodule(".".join(parts[:i + 1])) for i in range(len(parts) - 1)]:
        if getattr(m, "config", None) is model.config:
            m.config = cfg
    return root


def build_proposer(config: SpeculativeConfig, model: torch.nn.Module, tokenizer, *,
                   compile: Callable[..., Any], target_vocab: int, target_dtype: torch.dtype) -> Proposer:
    """The proposer ``config`` asks for; ``compile`` is ``optimize`` (passed in: this module sits beside it)."""
    if config.method == "ngram":
        return NgramProposer(config.min_ngram, config.max_ngram)
    options = {"dtype": target_dtype, "warmup": True, **config.draft_options}
    if "speculative" in options:
        raise ValueError("speculative.draft_options cannot themselves ask for speculation")
    if config.method == "head":
        n = model.config.num_hidden_layers
        if config.layers + config.last_layers >= n:
            raise ValueError(f"speculative.layers={config.layers} + last_layers={config.last_layers} must be fewer "
                             f"than the target's {n} layers (the head is a cheaper part of it)")
        keep = list(range(config.layers)) + list(range(n - config.last_layers, n))
        draft_model, name = layer_view(model, keep), "head"
    elif isinstance(config.model, str):  # "self-int4"
        draft_model, name = model, "self-int4"
        # the lm_head too: a draft's speed matters more than its last digits (bench/spec.py: 1.39x vs 1.11x
        # devin-compile with the lm_head kept, acceptance 0.74 vs 0.80, on open-ended prompts at k=4, bf16)
        options.setdefault("quantization", {"method": "rtn", "bits": 4, "group_size": 64, "lm_head": True})
    else:
        draft_model, name = config.model, "draft"
    draft_vocab = getattr(getattr(draft_model, "config", None), "vocab_size", None)
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative draft model has a vocabulary of {draft_vocab} tokens but the target has "
                         f"{target_vocab}; a draft must share the target's tokenizer")
    draft = compile(draft_model, tokenizer=tokenizer, **options)
    if draft.info.has_recurrent_state:
        raise ValueError(f"speculative method {config.method!r}: the draft has recurrent layers, whose own state a "
                         "draft proposer does not roll back; use method='ngram', or a draft model without recurrent "
                         "layers (the target may have them)")
    return DraftModelProposer(draft.engine.runner, name=name)


class DraftBuilder:
    """SpeculativeConfig → proposer for one target, at ``optimize()`` and for
    ``OptimizedModel.set_draft``; ``compile`` is ``optimize``. It holds the target model only
    weakly: the ``head`` and ``self-int4`` methods need it alive (or passed again as ``target=``);
    ``ngram`` and ``draft`` do not."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, vocab_size: int, dtype: torch.dtype,
                 compile: Callable[..., Any]) -> None:
        self._target = weakref.ref(model)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.compile = compile

    def __call__(self, spec: SpeculativeConfig, target: torch.nn.Module | None = None) -> Proposer:
        model = target if target is not None else self._target()
        needs_target = spec.method == "head" or (spec.method == "draft" and isinstance(spec.model, str))
        if needs_target and model is None:
            raise ValueError(f"speculative method {spec.method!r} builds its draft from the target model, which "
                             "is no longer alive; pass it again: set_draft(..., target=model)")
        return build_proposer(spec, model, self.tokenizer, compile=self.compile, target_vocab=self.vocab_size,
                              target_dtype=self.dtype)
