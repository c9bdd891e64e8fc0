"""ModelRunner: turns one scheduled step into graph inputs and runs the compiled graph.

It owns the paged KV pool and the attention backend chosen for the device. For each
step it packs the scheduled tokens end to end (``input_ids``/``position_ids`` [1, T]),
computes each new token's cache slot from the sequence's block table, asks for logits
only at the last token of sequences that will sample (and at the prompt positions a request
with ``prompt_logprobs`` scores this step), and runs the graph inside a
:func:`~devin_compile.step.step_context`.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..backends.attention.registry import AttentionBackend, select_attention_backend
from ..pipeline import Program
from ..step import AttentionMetadata, StateStep, StepContext, decode_bucket, step_context
from .decode_graphs import DecodeGraphs, pad_rows
from .kv_cache import PagedKVCache
from .state_pool import StatePool
from .step_plan import ScheduledSeq


class ModelRunner:
    def __init__(self, program: Program, kv_cache: PagedKVCache, *, vocab_size: int,
                 backend: AttentionBackend | None = None, device: torch.device | str = "cpu",
                 max_seq_len: int | None = None, recompute_depth: int = 1, max_step_tokens: int | None = None,
                 state_pool: StatePool | None = None) -> None:
        self.program = program
        # Recurrent layers' states (runtime/state_pool.py): each step passes its sequences' slots to the ops.
        self.state_pool = state_pool
        # The most tokens a step may pack (ModelInfo.max_step_tokens: the graph holds only up to it)
        self.max_step_tokens = max_step_tokens
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.backend = backend or select_attention_backend(self.device)
        # Pure-decode steps by bucket: CUDA Graphs, or compile_decode's callables (None: the decode graph).
        # (not for recurrent models: their steps also need state slots, which the static buffers do not carry)
        pool_tokens = kv_cache.num_blocks * kv_cache.block_size
        self.decode_graphs = None if state_pool is not None else DecodeGraphs.for_runner(
            program, kv_cache, self.backend, self.device, max_seq_len=min(max_seq_len or pool_tokens, pool_tokens),
            recompute_depth=recompute_depth)
        # Pad pure-decode batches the decode graph runs (eagerly) up to their bucket: tests turn it
        # on to check padding alone.
        self.pad_decode = False
        # Keys attention read vs keys that exist, summed over steps whose backend batched
        # sequences into padded rectangles (length-aware grouping; see backends/attention/length_groups.py).
        self.attention_real_keys = 0
        self.attention_padded_keys = 0
        # Called with run()'s inputs (all but kv_prune) before each forward: tensor parallelism's
        # rank 0 broadcasts them to the other ranks (runtime/distributed.py).
        self.before_run: Callable[[tuple], None] | None = None

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def slot_mapping(self, block_table: list[int], first_slot: int, n: int) -> list[int]:
        """Flat cache slots of a sequence's slots ``first_slot .. first_slot + n - 1``."""
        bs = self.block_size
        return [block_table[s // bs] * bs + s % bs for s in range(first_slot, first_slot + n)]

    def graph_for(self, decode: bool):
        """The graph for a step run uncaptured: ``decode`` for decode steps (when split), otherwise
        the ``prefill`` (or unsplit ``main``) graph."""
        g = self.program.graphs
        if decode and "decode" in g:
            return g["decode"]
        return g.get("prefill") or g["main"]

    @staticmethod
    def is_decode_step(query_lens: list[int], logits_indices: list[int]) -> bool:
        """One token per sequence and every one of them needs logits (what the decode graph computes)."""
        return max(query_lens) == 1 and logits_indices == list(range(len(query_lens)))

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
            seq_lens: list[int], block_tables: list[list[int]], logits_indices: list[int],
            kv_prune=None, state_slots: list[int] | None = None) -> torch.Tensor:
        """One forward over packed tokens; returns float logits [len(logits_indices), vocab]. ``state_slots``:
        each sequence's state-pool slot (models with recurrent layers)."""
        if self.max_step_tokens is not None and len(input_ids) > self.max_step_tokens:
            raise RuntimeError(f"a step of {len(input_ids)} tokens, but this model's graph holds at most "
                               f"{self.max_step_tokens} (ModelInfo.max_step_tokens); the scheduler caps steps at it")
        if self.before_run is not None:
            self.before_run((input_ids, positions, slots, query_lens, seq_lens, block_tables, logits_indices))
        n_real = len(query_lens)
        decode = self.is_decode_step(query_lens, logits_indices) and "decode" in self.program.graphs
        if decode and kv_prune is None and self.decode_graphs is not None:
            done = self.decode_graphs.run(input_ids, positions, slots, seq_lens, block_tables)
            if done is not None:
                self._count_padding(done[1])
                return done[0]
        if decode and self.pad_decode:
            bucket = decode_bucket(n_real, self.program.decode_buckets)
            if bucket is not None:  # above the largest bucket: run unpadded
                input_ids, positions, slots, seq_lens, block_tables = pad_rows(
                    n_real, bucket, input_ids, positions, slots, seq_lens, block_tables)
                query_lens = [1] * bucket
                logits_indices = list(range(bucket))
        states = self._state_step(state_slots, len(query_lens))
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, slots, device=self.device)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        idx = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        with torch.inference_mode(), step_context(StepContext(meta, self.kv_cache, self.backend, kv_prune, states)):
            logits = self.graph_for(decode)(ids, pos, idx)
        self._count_padding(meta)
        return logits[0, :n_real] if decode else logits[0]

    def _state_step(self, state_slots: list[int] | None, num_seqs: int) -> StateStep | None:
        """The step's :class:`StateStep` (padded rows past ``state_slots`` get -1: no state), or None."""
        if self.state_pool is None:
            return None
        if state_slots is None:
            raise ValueError("this model has recurrent layers: ModelRunner.run needs each sequence's state_slots")
        return StateStep(self.state_pool, list(state_slots) + [-1] * (num_seqs - len(state_slots)))

    def _count_padding(self, meta: AttentionMetadata) -> None:
        padding = meta.scratch.get("attention_padding")
        if padding is not None:
            self.attention_real_keys += padding[0]
            self.attention_padded_keys += padding[1]

    def execute(self, batch: list[ScheduledSeq], kv_prune=None) -> tuple[torch.Tensor, list[int]]:
        """Run a scheduled step. Returns (logits, row → index into ``batch``) for the
        sequences whose chunk reaches their last known token (they sample next).

        Speculation: a decoding sequence with proposals (``item.draft``) owns ``1 + len(draft)``
        consecutive logits rows. Each proposal runs as a decode row of its own, after all the
        batch's sequences: same block table, the next position and slot, a sequence length one
        longer than the row before (so it sees the rows before it and not those after; every
        backend writes a layer's new K/V before attending). A verify step of decoding sequences
        is then a pure decode step for the graphs and kernels (the decode graph, the C decode
        kernel), and batch indices stay those of ``batch`` (KV pruning's rows). With recurrent layers the
        proposals instead extend the sequence's own chunk (``1 + len(draft)`` tokens, a logits row each), so
        the recurrent ops run through them from its state (``speculative/state_rollback.py`` undoes them).

        Prompt logprobs: after those rows come the rows of every item's ``scored`` positions (items in
        batch order, positions in order); ``len(owners)`` tells where they start."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens, slens, tables, logit_rows, owners, prompt_rows = [], [], [], [], [], []
        proposals = []
        for i, item in enumerate(batch):
            seq, start = item.seq, item.seq.num_computed
            # recurrent layers: the proposals extend the sequence's own chunk (the ops carry its state through them)
            joined = item.draft if self.state_pool is not None else []
            n = item.num_tokens + len(joined)
            prompt_rows.extend(len(ids) + p - start for p in item.scored)
            ids.extend(list(seq.all_ids[start:start + item.num_tokens]) + joined)
            pos.extend(range(start, start + n))
            table = seq.block_table
            s0 = seq.num_slots  # KV pruning: slots lag positions by the evicted tokens
            slots.extend(self.slot_mapping(table, s0, n))
            qlens.append(n)
            slens.append(s0 + n)
            tables.append(table)
            if start + item.num_tokens == seq.num_tokens:
                logit_rows.extend(range(len(ids) - 1 - len(joined), len(ids)))
                owners.extend([i] * (1 + len(joined)))
                if not joined:
                    proposals.extend((tok, start + n + j, s0 + n + j, table, i) for j, tok in enumerate(item.draft))
        for tok, p, slot, table, i in proposals:
            ids.append(tok)
            pos.append(p)
            slots.extend(self.slot_mapping(table, slot, 1))
            qlens.append(1)
            slens.append(slot + 1)
            tables.append(table)
            logit_rows.append(len(ids) - 1)
            owners.append(i)
        rows = logit_rows + prompt_rows
        # only mid-prompt chunks and no prompt scored: the graph still needs one logits row
        state_slots = [item.seq.state_slot for item in batch] if self.state_pool is not None else None
        logits = self.run(ids, pos, slots, qlens, slens, tables, rows or [len(ids) - 1], kv_prune, state_slots)
        if not rows:
            return logits[:0], []
        if proposals:  # each owner's rows together, in position order (a stable sort by owner)
            order = sorted(range(len(owners)), key=owners.__getitem__)
            logits = torch.cat([logits[order], logits[len(owners):]]) if prompt_rows else logits[order]
            owners = [owners[r] for r in order]
        return logits, owners

    def forward_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence [T, vocab], computed from scratch into
        ``block_table`` (enough blocks for ``len(token_ids)`` slots, owned by the caller), in steps of at
        most ``max_step_tokens`` tokens where the graph has that limit (each over the cached ones before)."""
        if self.state_pool is not None:  # recurrent layers: a slot for this sequence's state, lent for the forward
            with self.state_pool.borrow("forward_logits") as slot:
                return self._forward_logits(token_ids, block_table, [slot])
        return self._forward_logits(token_ids, block_table, None)

    def _forward_logits(self, token_ids: list[int], block_table: list[int], state_slots: list[int] | None):
        n = len(token_ids)
        step = self.max_step_tokens or max(n, 1)
        parts = []
        for s in range(0, max(n, 1), step):
            e = min(n, s + step)
            parts.append(self.run(list(token_ids[s:e]), list(range(s, e)), self.slot_mapping(block_table, s, e - s),
                                  [e - s], [e], [block_table], list(range(e - s)), state_slots=state_slots))
        return torch.cat(parts) if len(parts) != 1 else parts[0]
