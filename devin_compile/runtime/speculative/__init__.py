"""Speculative decoding: proposers (n-gram lookup, a draft model, the target's own first layers),
verification (greedy and rejection sampling), adaptive lengths and counters; the engine drives
it through :class:`SpeculativeDecoder`."""
from .acceptance import accept_greedy, accept_sampled
from .adaptive import SpecState
from .decoder import SpeculativeDecoder
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .proposer import Draft, DraftRequest, Proposer
from .stats import SpecMetrics

__all__ = ["accept_greedy", "accept_sampled", "Draft", "DraftModelProposer", "DraftRequest", "NgramProposer",
           "Proposer", "SpecMetrics", "SpecState", "SpeculativeDecoder"]
