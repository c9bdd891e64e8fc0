"""The bottom floor: per-step metadata, the step context and hooks, the backend protocol.

What ops, backends and the runtime share, and nothing above it: this module imports only
torch. How runtime state reaches ``devin::`` ops:

Graphs never hold block tables, slot mappings or sequence lengths as constants. The
runtime builds an :class:`AttentionMetadata` for each step and installs it, together
with the KV cache and the chosen attention backend, with :func:`step_context`. Ops read
it with :func:`current_context`.

Token layout (all sequences packed end to end, no padding)::

    input_ids          [1, T]
    query_start_loc    [B+1]  int32, sequence b owns tokens query_start_loc[b]:query_start_loc[b+1]
    seq_lens           [B]    int32, cached tokens of b *after* this step's tokens are written
    block_tables       [B, M] int32, physical block of b's logical block j (padding: 0, never read)
    slot_mapping       [T]    int64, flat cache slot (block * block_size + offset) for each new token;
                              -1 means "write nothing" (padded decode slots)

Query token i of sequence b (0-based within the step) may attend to cached slots
``0 .. seq_lens[b] - q_len_b + i`` (causal by slot index, which keeps working after KV
pruning compacts a sequence's slots).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import torch


@dataclass
class AttentionMetadata:
    """The attention half of one step's metadata (see module docstring for layout)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so CPU backends can loop without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    block_tables_host: list[list[int]] = field(default_factory=list)
    has_padded_slots: bool = False
    # Per-step memo for backends: tensors derived from this metadata once per step and
    # reused by every layer (e.g. a decode gather index). Never holds KV data.
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build tensors from host lists (one sequence per entry)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        width = max((len(bt) for bt in block_tables), default=1) or 1
        table = torch.tensor([list(bt) + [0] * (width - len(bt)) for bt in block_tables], dtype=torch.int32)
        table = table.view(len(block_tables), width)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        dev = torch.device(device)
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
            block_tables_host=[list(bt) for bt in block_tables],
            has_padded_slots=any(s < 0 for s in slot_mapping),
        )


class PagedKV(Protocol):
    """What ops read of the paged KV cache (runtime.kv_cache.PagedKVCache implements it)."""

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]."""
        ...


class AttentionBackend(Protocol):
    """A kernel behind ``devin::paged_attention`` (backends/attention/ registers them)."""

    name: str
    priority: int

    def is_available(self, device: torch.device) -> bool: ...

    def supports(self, *, dtype: torch.dtype, head_dim: int, softcap: float, sliding_window: int,
                 block_size: int | None = None, alibi: bool = False, sinks: bool = False,
                 attention_chunk: int = -1) -> bool:
        """False to decline one call (it then runs on the torch reference). The last three are passed
        only to calls that have them, which then get the matching ``forward`` keyword:
        ``alibi`` → ``alibi_slopes=[Hq] float32`` (add ``slope_h · (key slot − query slot)`` to every
        score); ``sinks`` → ``sinks=[Hq] float32`` (a logit per head that joins the softmax's
        denominator, attending to nothing); ``attention_chunk=C`` → the same (the query at slot p
        sees only slots ``floor(p / C)·C .. p``, beside any window)."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        *, scale: float, softcap: float, sliding_window: int,
    ) -> torch.Tensor:
        """Write k/v ([T, Hkv, D]) into the paged cache at ``meta.slot_mapping``, then attend.

        q: [T, Hq, D]; returns [T, Hq, Dv] in q's dtype.
        """
        ...


class RecurrentStates(Protocol):
    """What recurrent-layer ops read of the state pool (runtime.state_pool.StatePool implements it)."""

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Recurrent layer ``i``'s state tensors, each ``[num_slots, ...]`` (slot = one sequence)."""
        ...


@dataclass
class StateStep:
    """The recurrent half of one step: the state pool and each sequence's slot in it (in the order of
    ``AttentionMetadata.query_start_loc``; -1: a padded row, which reads a zero state and writes nothing).
    A sequence whose cached length before the step (``seq_lens - query_len``) is 0 starts from a zero state."""

    pool: RecurrentStates
    slots: list[int]


@dataclass
class StepContext:
    """What ops may read during one forward: metadata, the KV cache, the backend."""

    attn: AttentionMetadata
    kv_cache: PagedKV
    backend: AttentionBackend
    kv_prune: Any = None  # runtime.kv_prune.PruneStep on steps where a sequence prunes its KV cache
    states: StateStep | None = None  # models with recurrent layers (Mamba2 mixers): their state slots


_local = threading.local()

# (enter, exit) pairs called with the context around every step, exit even when the step
# fails: how a backend keeps native per-step state (cpu_sdpa's C++ decode path) in step.
_STEP_HOOKS: list[tuple[Callable[[StepContext], None], Callable[[StepContext], None]]] = []


def add_step_hook(enter: Callable[[StepContext], None], exit: Callable[[StepContext], None]) -> None:
    """Call ``enter(ctx)`` / ``exit(ctx)`` around every later :func:`step_context` (once per pair)."""
    if (enter, exit) not in _STEP_HOOKS:
        _STEP_HOOKS.append((enter, exit))


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Install ``ctx`` for the ops run inside the ``with`` block (re-entrant, thread-local),
    with the step hooks (:func:`add_step_hook`) around it."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    entered = []
    try:
        for enter, exit in list(_STEP_HOOKS):
            enter(ctx)
            entered.append(exit)
        yield ctx
    finally:
        for exit in reversed(entered):
            exit(ctx)
        _local.ctx = prev


def decode_bucket(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest decode bucket (sorted ascending) that holds ``batch`` sequences, or None
    above the largest: the batch size a static-shape decode callable pads a step up to."""
    for b in buckets:
        if b >= batch:
            return b
    return None


def reachable_buckets(buckets: tuple[int, ...], max_rows: int) -> tuple[int, ...]:
    """The decode buckets a step of at most ``max_rows`` rows can use: those below it and the first
    one at or above it (what ahead-compiled and captured decode steps are built for)."""
    below = [b for b in buckets if b < max_rows]
    above = [b for b in buckets if b >= max_rows]
    return tuple(below + above[:1])


def current_context() -> StepContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "devin::paged_attention ran outside a runtime step: no step context is installed. "
            "Run the compiled graph through devin_compile's Engine/OptimizedModel, or wrap the call "
            "in devin_compile.step.step_context(...)."
        )
    return ctx
