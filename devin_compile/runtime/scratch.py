"""Scratch steps: run a compiled graph outside serving, on a throwaway paged KV cache.

A probe (``optimize(verify=True)``) or a pass that compiles a graph by running it
(``compile_decode``) needs what the runtime installs for every step: a KV cache, the
step's :class:`~devin_compile.step.AttentionMetadata` and an attention backend.
:func:`scratch_step` builds all three for one step of fresh sequences; passes get it
through ``PassContext.scratch_step`` (bound to the model by :func:`scratch_steps`), so they
import nothing from the runtime.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ..backends.attention.registry import select_attention_backend
from ..capture import ModelInfo
from ..pipeline import ScratchStep
from ..step import AttentionBackend, AttentionMetadata, StateStep, StepContext, step_context
from .kv_cache import KVCacheSpec, PagedKVCache
from .state_pool import StatePool

SCRATCH_BLOCK_SIZE = 16


@contextlib.contextmanager
def scratch_step(info: ModelInfo, device: torch.device | str, query_lens: Sequence[int], *,
                 backend: AttentionBackend | None = None,
                 block_size: int = SCRATCH_BLOCK_SIZE) -> Iterator[StepContext]:
    """Install a step context for one step of ``len(query_lens)`` fresh sequences (sequence i
    has ``query_lens[i]`` tokens and nothing cached before them) over a new paged KV cache
    that holds exactly their blocks, laid out one sequence after another. ``backend``:
    the attention backend (default: the registry's pick for ``device``)."""
    dev = torch.device(device)
    spec = KVCacheSpec(info.num_layers, dtype=info.dtype, block_size=block_size, **info.kv_cache_layout)
    tables, slots, next_block = [], [], 0
    for n in query_lens:
        blocks = list(range(next_block, next_block + (n + block_size - 1) // block_size))
        next_block += len(blocks)
        tables.append(blocks)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(n))
    cache = PagedKVCache(spec, next_block, dev)
    meta = AttentionMetadata.build(list(query_lens), list(query_lens), tables, slots, dev)
    states = None
    if info.has_recurrent_state:  # recurrent layers: a fresh state slot per sequence
        pool = StatePool(info.recurrent_states, len(query_lens), dev)
        states = StateStep(pool, [pool.allocate(f"scratch-{i}") for i in range(len(query_lens))])
    with step_context(StepContext(meta, cache, backend or select_attention_backend(dev), states=states)) as ctx:
        yield ctx


def scratch_steps(info: ModelInfo, device: torch.device | str | None = None, *,
                  backend: AttentionBackend | None = None) -> ScratchStep:
    """:func:`scratch_step` bound to a model and device (default: the model's): what
    ``PassContext.scratch_step`` holds."""
    dev = info.device if device is None else device

    def bound(query_lens: Sequence[int]):
        return scratch_step(info, dev, query_lens, backend=backend)

    return bound
