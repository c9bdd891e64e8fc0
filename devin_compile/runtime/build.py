"""Building an engine from a compiled program: KV pool, attention backend, runner, KV tiers,
speculation, engine — what ``optimize()`` does after the passes.

:func:`build_engine` sizes the paged KV pool (``num_kv_blocks`` > ``kv_cache_memory`` >
``kv_cache_fraction`` of free memory), picks and warms the attention backend for the device,
and wires the runner, the KV tiers (keyed by :class:`ModelIdentity`) and speculative decoding
(the proposer, built by the caller, which may compile a draft) into an :class:`Engine`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..backends.attention.registry import select_attention_backend
from ..cache import sampled_state_dict_digest
from ..capture import ModelInfo
from ..config import OptimizeConfig
from ..pipeline import Program
from .engine import Engine
from .kv_cache import KVCacheSpec, PagedKVCache, blocks_for_budget
from .kv_tiers import KVTiers
from .model_runner import ModelRunner
from .state_pool import StatePool
from .speculative import Proposer, SpeculativeDecoder


@dataclass(frozen=True)
class ModelIdentity:
    """What a model's K/V depend on besides dtype, KV layout and block size (which the pool adds):
    the weights (a sampled digest), the model config and the quantization. Keys the KV tiers, so
    replicas of the same model share blocks and different models never do."""

    weights_digest: str
    model_config: str
    quantization: str | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, quantization: object = None) -> "ModelIdentity":
        hf = getattr(model, "config", None)
        facts = {k: v for k, v in (hf.to_dict() if hf is not None else {}).items()
                 if not k.startswith("_") and k != "transformers_version"}
        return cls(sampled_state_dict_digest(model.state_dict()), json.dumps(facts, sort_keys=True, default=str),
                   None if quantization is None else json.dumps(quantization, sort_keys=True, default=str))


def build_engine(program: Program, info: ModelInfo, config: OptimizeConfig, *, tokenizer=None,
                 proposer: Proposer | None = None, identity: ModelIdentity | None = None,
                 kv_tiers_for=None) -> Engine:
    """The engine that runs ``program`` under ``config``. ``identity`` is needed with ``kv_cache_tiers``;
    ``proposer`` with ``speculative``; ``kv_tiers_for(config, pool, identity)`` builds the KV tiers instead
    of :func:`kv_tiers_over` (tensor parallelism: runtime/kv_tiers_tp.py)."""
    spec = KVCacheSpec(info.num_layers, dtype=info.dtype, block_size=config.cache.block_size, **info.kv_cache_layout)
    num_blocks = blocks_for_budget(spec, info.device, num_blocks=config.cache.num_blocks,
                                   memory_bytes=config.cache.memory_bytes, memory_fraction=config.cache.memory_fraction)
    pool = PagedKVCache(spec, num_blocks, info.device)
    backend = select_attention_backend(info.device, config.attention_backend)
    if config.warmup and hasattr(backend, "warm_up"):
        backend.warm_up(dtype=info.dtype, num_kv_heads=info.num_kv_heads, num_heads=info.num_heads,
                        head_dim=info.head_dim)
    # Recurrent layers: one state slot per sequence the scheduler may run at once.
    states = (StatePool(info.recurrent_states, config.scheduler.max_num_seqs, info.device)
              if info.has_recurrent_state else None)
    runner = ModelRunner(program, pool, vocab_size=info.vocab_size, backend=backend, device=info.device,
                         max_seq_len=info.max_model_len, recompute_depth=config.cuda_graph_recompute_depth,
                         max_step_tokens=info.max_step_tokens, state_pool=states)
    speculative = SpeculativeDecoder(config.speculative, proposer) if config.speculative is not None else None
    return Engine(runner, config.scheduler, max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
                  tokenizer=tokenizer, enable_prefix_caching=config.cache.enable_prefix_caching and states is None,
                  kv_prune=config.kv_prune, kv_tiers=(kv_tiers_for or kv_tiers_over)(config, pool, identity),
                  speculative=speculative)


def kv_tiers_over(config: OptimizeConfig, pool: PagedKVCache, identity: ModelIdentity | None) -> KVTiers | None:
    """``config``'s KV tiers over ``pool``, keyed by the model's ``identity`` (None without tiers)."""
    if not config.kv_cache_tiers:
        return None
    if identity is None:
        raise ValueError("kv_cache_tiers need the model's identity (weights digest, config) to key the blocks")
    return KVTiers.for_model(config.kv_cache_tiers, pool, weights_digest=identity.weights_digest,
                             quantization=identity.quantization, model_config=identity.model_config)
