"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seed.

Greedy rows are decided together with one ``argmax``; sampled rows use each request's
own ``torch.Generator`` (seeded when ``seed`` is given), so a request's tokens do not
depend on what it is batched with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from .logprobs import MAX_LOGPROBS

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
MIN_TEMPERATURE = 1e-30  # logits up to 3e8 divided by it stay finite in float32


@dataclass
class SamplingParams:
    """Per-request generation settings, validated at construction (``ValueError``)."""

    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    # KV pruning for this request: None (the engine's / enable_kv_pruning's setting), False (off),
    # or a dict / KVPruneConfig (see devin_compile.config.KVPruneConfig).
    kv_prune: object = None
    # Speculative decoding for this request: None (the engine's setting), False (off), True (on with the
    # engine's settings), or a dict / SpeculativeRequest (num_tokens, acceptance_threshold, adaptive).
    speculative: object = None
    # Log-probabilities of the emitted tokens (runtime/logprobs.py): None (off), or how many top
    # alternatives to keep per token (0..20; 0: the chosen token's logprob only).
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens after the first (runtime/prompt_logprobs.py), each
    # under the prompt before it: None (off) or how many top alternatives to keep (0..20).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        m = self.max_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0 or (m == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_new_tokens={m!r} must be a positive integer (0 only with prompt_logprobs: "
                             "score the prompt alone)")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables top-k)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        if any(not callable(p) for p in self.logits_processors):
            raise ValueError("logits_processors must be callables (token_ids, logits) -> logits")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name}={k!r} must be None (off) or an integer in [0, {MAX_LOGPROBS}] "
                                 "(top alternatives per token)")
        if self.kv_prune is not None and self.kv_prune is not False:
            from ..config import KVPruneConfig

            self.kv_prune = KVPruneConfig.coerce(self.kv_prune, "SamplingParams.kv_prune")
        if self.speculative is not None:
            from ..config import SpeculativeRequest

            self.speculative = SpeculativeRequest.coerce(self.speculative)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (with -inf) everything outside the top-k and the top-p nucleus; logits is [V]."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass *before* it already reaches top_p; the first always stays (a top_p
        # below float32's range compares as 0 and would otherwise drop every token)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax of the temperature-scaled, top-k /
    top-p filtered float logits [V] (or [N, V], row by row)."""
    if logits.dim() == 2:
        return torch.stack([sampling_probs(row, params) for row in logits])
    # a temperature so small that logits / temperature would overflow float32 samples as it tends to: the
    # top logit (ties shared)
    temperature = max(params.temperature, MIN_TEMPERATURE)
    logits = _filter_top_k_top_p(logits / temperature, params.top_k, params.top_p)
    return torch.softmax(logits, dim=-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of float32 logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def sample_batch(logits: torch.Tensor, params: Seq[SamplingParams],
                 generators: Seq[torch.Generator | None]) -> list[int]:
    """Tokens for each row of logits [N, V] (rows without processors/sampling share one argmax)."""
    greedy = [p.greedy for p in params]
    out: list[int] = [0] * len(params)
    if any(greedy):
        # the first index of each row's maximum, as argmax; max(dim) reduces faster on CPU (64 x 49k: 0.8 vs 2.3 ms)
        best = logits.max(dim=-1).indices.tolist()
        for i, g in enumerate(greedy):
            if g:
                out[i] = best[i]
    for i, p in enumerate(params):
        if not greedy[i]:
            out[i] = sample_row(logits[i].float(), p, generators[i])
    return out
