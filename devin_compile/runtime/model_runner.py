"""ModelRunner: turns one scheduled step into graph inputs and runs the compiled graph.

It owns the paged KV pool and the attention backend chosen for the device. For each
step it packs the scheduled tokens end to end (``input_ids``/``position_ids`` [1, T]),
computes each new token's cache slot from the sequence's block table, asks for logits
only at the last token of sequences that will sample, and runs the graph inside a
:func:`~devin_compile.runtime.context.step_context`.
"""
from __future__ import annotations

import torch

from ..backends.registry import AttentionBackend, select_attention_backend
from ..pipeline import Program
from .context import AttentionMetadata, StepContext, step_context
from .kv_cache import PagedKVCache
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, program: Program, kv_cache: PagedKVCache, *, vocab_size: int,
                 backend: AttentionBackend | None = None, device: torch.device | str = "cpu") -> None:
        self.program = program
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.backend = backend or select_attention_backend(self.device)

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def graph_for(self, meta: AttentionMetadata) -> torch.fx.GraphModule:
        """The phase graph for this step: ``decode`` for pure-decode steps when split, else ``prefill``/``main``."""
        g = self.program.graphs
        if meta.is_pure_decode and "decode" in g:
            return g["decode"]
        return g.get("prefill") or g["main"]

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
            seq_lens: list[int], block_tables: list[list[int]], logits_indices: list[int]) -> torch.Tensor:
        """One forward over packed tokens; returns float logits [len(logits_indices), vocab]."""
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, slots, device=self.device)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        idx = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        with torch.inference_mode(), step_context(StepContext(meta, self.kv_cache, self.backend)):
            logits = self.graph_for(meta)(ids, pos, idx)
        return logits[0]

    def execute(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Run a scheduled step. Returns (logits, row → index into ``batch``) for the
        sequences whose chunk reaches their last known token (they sample next)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens, slens, tables, logit_rows, owners = [], [], [], [], []
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            ids.extend(seq.all_ids[start:start + n])
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qlens.append(n)
            slens.append(start + n)
            tables.append(table)
            if start + n == seq.num_tokens:
                logit_rows.append(len(ids) - 1)
                owners.append(i)
        if not logit_rows:  # only mid-prompt chunks this step: still need one logits row for the graph
            logit_rows = [len(ids) - 1]
            logits = self.run(ids, pos, slots, qlens, slens, tables, logit_rows)
            return logits[:0], []
        logits = self.run(ids, pos, slots, qlens, slens, tables, logit_rows)
        return logits, owners
