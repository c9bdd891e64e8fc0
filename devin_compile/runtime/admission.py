"""The one admission check: may the engine take this request? Else a :class:`RequestRejected`
naming the input at fault and the way out.

Every front door calls it — :meth:`Engine.add_request`, ``OptimizedModel.generate``, the HTTP
server (before it answers 200) — so a request that passes it is refused later only by things
that depend on what else runs (a pool that is full now is waited for, not refused).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch

from ..config import KVPruneConfig
from .kv_prune import resolve_request
from .sampling import SamplingParams


class RequestRejected(ValueError):
    """An invalid request; ``param`` names the input at fault: ``"prompt"``, ``"max_new_tokens"``,
    ``"params"``, ``"speculative"``, ``"kv_prune"`` or ``"request_id"``. The message speaks to a
    Python caller; ``code`` and ``facts`` (the numbers in it) let another front door (the HTTP
    server) say the same in its own words: ``"no_speculation"``, ``"no_kv_prune"``,
    ``"context_exceeded"`` or ``"pool_exceeded"`` (None: the message suits any caller)."""

    def __init__(self, message: str, param: str, code: str | None = None, **facts) -> None:
        super().__init__(message)
        self.param, self.code, self.facts = param, code, facts

    def prefixed(self, prefix: str) -> "RequestRejected":
        """The same rejection with ``prefix`` before its message (e.g. which request of a batch)."""
        return RequestRejected(f"{prefix}{self}", self.param, self.code, **self.facts)


def check_params_type(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise RequestRejected(f"params must be a SamplingParams, got {type(params).__name__}", "params")


@dataclass
class AdmittedRequest:
    """A request that passed: its token ids and its resolved KV-pruning setting."""

    prompt_ids: list[int]
    kv_prune: KVPruneConfig | None


@dataclass
class AdmissionCheck:
    """The engine's limits: context length, KV pool, vocabulary, tokenizer, and what it can run."""

    max_model_len: int
    pool_tokens: int
    vocab_size: int
    tokenizer: Any = None
    kv_prune: KVPruneConfig | None = None  # the model's KV-pruning setting (None: no kv_prune nodes)

    @property
    def token_limit(self) -> int:
        """Prompt + new tokens one request may reach: the smaller of the context and the pool."""
        return min(self.max_model_len, self.pool_tokens)

    def check(self, prompt: str | Seq[int] | torch.Tensor, params: SamplingParams, *,
              can_speculate: bool) -> AdmittedRequest:
        """The whole check: ``params``, the prompt's tokens, then :meth:`check_ids`."""
        check_params_type(params)
        ids = self.encode(prompt)
        return AdmittedRequest(ids, self.check_ids(ids, params, can_speculate=can_speculate))

    def check_ids(self, ids: list[int], params: SamplingParams, *, can_speculate: bool) -> KVPruneConfig | None:
        """Lengths against the context and the pool, and the features ``params`` ask for; returns the
        request's resolved KV-pruning setting."""
        self.check_lengths(len(ids), params.max_new_tokens)
        if params.speculative not in (None, False) and not can_speculate:
            raise RequestRejected("SamplingParams.speculative is set but this model has no speculative decoding; "
                                  "pass speculative={'method': 'ngram'} (or draft/head) to optimize()", "speculative",
                                  "no_speculation")
        try:
            return resolve_request(self.kv_prune, params)
        except ValueError as e:
            raise RequestRejected(str(e), "kv_prune", "no_kv_prune" if self.kv_prune is None else None) from None

    def encode(self, prompt: str | Seq[int] | torch.Tensor) -> list[int]:
        """Token ids of a text (the tokenizer, no special tokens), a tensor or a list; checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected("a text prompt needs a tokenizer: pass tokenizer= to optimize()", "prompt")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.flatten().tolist()
        else:
            ids = list(prompt)
        if not ids:
            raise RequestRejected("empty prompt: give at least one token", "prompt")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}", "prompt")
        return ids

    def check_lengths(self, num_prompt: int, max_new_tokens: int) -> None:
        if num_prompt >= self.max_model_len:
            raise RequestRejected(f"prompt has {num_prompt} tokens but the model's context is {self.max_model_len}; "
                                  "shorten the prompt", "prompt")
        total = num_prompt + max_new_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"prompt ({num_prompt}) + max_new_tokens ({max_new_tokens}) = {total} tokens exceeds the model's "
                f"context of {self.max_model_len}; lower max_new_tokens or shorten the prompt", "max_new_tokens",
                "context_exceeded", prompt=num_prompt, new=max_new_tokens, context=self.max_model_len)
        if total > self.pool_tokens:
            raise RequestRejected(
                f"needs {total} KV slots but the whole KV pool holds {self.pool_tokens}; "
                "raise kv_cache_memory / num_kv_blocks or lower max_new_tokens", "max_new_tokens",
                "pool_exceeded", prompt=num_prompt, new=max_new_tokens, pool=self.pool_tokens)
