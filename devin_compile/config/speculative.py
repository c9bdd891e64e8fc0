"""Speculative decoding: the engine's setting and one request's override."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..validation import flag, from_mapping, int_at_least, number_in, one_of, positive_int


SPEC_METHODS = ("ngram", "draft", "head")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (see :mod:`devin_compile.runtime.speculative`).

    ``method``: ``"ngram"`` (prompt/context lookup: the longest suffix of ``max_ngram`` down to
    ``min_ngram`` tokens seen before proposes what followed it), ``"draft"`` (``model``: any HF
    causal LM with the target's vocabulary, compiled by devin-compile with ``draft_options``; or
    ``"self-int4"``: an RTN INT4 copy of the target) or ``"head"`` (self-speculative: the target's
    first ``layers`` decoder layers, plus its last ``last_layers``, with its final norm and lm_head,
    sharing its weights). ``num_tokens``: the most tokens proposed per step. A draft stops
    proposing when its own probability of the next token is below ``acceptance_threshold``.
    ``adaptive``: each request's length follows its recent acceptance (longer when all are
    accepted, shorter when rejected, paused with growing back-off while acceptance stays low).
    ``max_verify_tokens``: a step's verify tokens (sequences x (1 + proposed)) are kept at or
    below it, so speculation turns itself down as the batch grows (16: off from 16 sequences
    on). ``recompute_depth``: how many times a verify step whose logits hold NaN/inf is
    recomputed before its request fails.
    """

    method: str = "ngram"
    num_tokens: int = 4
    min_ngram: int = 1
    max_ngram: int = 4
    model: Any = None
    draft_options: dict = field(default_factory=dict)
    layers: int = 2
    last_layers: int = 0
    acceptance_threshold: float = 0.0
    adaptive: bool = True
    max_verify_tokens: int = 16
    recompute_depth: int = 3

    def __post_init__(self) -> None:
        one_of("speculative.method", self.method, SPEC_METHODS)
        positive_int("speculative.num_tokens", self.num_tokens, hint="tokens proposed per step")
        positive_int("speculative.min_ngram", self.min_ngram)
        positive_int("speculative.max_ngram", self.max_ngram)
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"speculative.max_ngram={self.max_ngram} is below min_ngram={self.min_ngram}")
        positive_int("speculative.layers", self.layers, hint="the target's first decoder layers the head runs")
        int_at_least("speculative.last_layers", self.last_layers, 0)
        number_in("speculative.acceptance_threshold", self.acceptance_threshold, 0.0, 1.0, hi_open=True,
                  hint="the draft's own probability below which it stops proposing; 0: off")
        flag("speculative.adaptive", self.adaptive)
        positive_int("speculative.max_verify_tokens", self.max_verify_tokens,
                     hint="verify tokens per step, sequences x (1 + proposed)")
        int_at_least("speculative.recompute_depth", self.recompute_depth, 0)
        if not isinstance(self.draft_options, Mapping):
            raise ValueError(f"speculative.draft_options={self.draft_options!r} must be a dict of optimize() options")
        if self.method == "draft":
            if self.model is None:
                raise ValueError("speculative.method='draft' needs model=: an HF causal LM with the target's "
                                 "vocabulary, or 'self-int4'")
            if isinstance(self.model, str) and self.model != "self-int4":
                raise ValueError(f"speculative.model={self.model!r}: give a model object or 'self-int4'")
        elif self.model is not None:
            raise ValueError(f"speculative.model= is for method='draft', not method={self.method!r}")
        if self.draft_options and self.method == "ngram":
            raise ValueError("speculative.draft_options= is for the draft and head methods; ngram has no model")

    @classmethod
    def coerce(cls, value: Any, what: str = "speculative") -> "SpeculativeConfig | None":
        """None/False → None (off); a method name → its defaults; a dict or SpeculativeConfig → validated."""
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, Mapping):
            return from_mapping(cls, value, what)
        raise ValueError(f"{what}={value!r} must be a method name ({', '.join(SPEC_METHODS)}), a dict "
                         "(e.g. {'method': 'ngram', 'num_tokens': 4}), a SpeculativeConfig, or None")


@dataclass
class SpeculativeRequest:
    """One request's override of the engine's speculation (``SamplingParams(speculative={...})``);
    None keeps the engine's setting."""

    num_tokens: int | None = None
    acceptance_threshold: float | None = None
    adaptive: bool | None = None

    def __post_init__(self) -> None:
        positive_int("speculative.num_tokens", self.num_tokens, optional=True, hint="tokens proposed per step")
        number_in("speculative.acceptance_threshold", self.acceptance_threshold, 0.0, 1.0, hi_open=True,
                  optional=True)
        if self.adaptive is not None:
            flag("speculative.adaptive", self.adaptive)

    @classmethod
    def coerce(cls, value: Any) -> "SpeculativeRequest | bool | None":
        """None (the engine's setting), False (off for this request), True (on, engine settings), or a dict."""
        if value is None or isinstance(value, (bool, cls)):
            return value
        if isinstance(value, Mapping):
            return from_mapping(cls, value, "SamplingParams.speculative")
        raise ValueError(f"SamplingParams.speculative={value!r} must be None, False, True or a dict like "
                         "{'num_tokens': 6, 'acceptance_threshold': 0.3}")
