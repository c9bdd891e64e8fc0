"""Draft-model proposer: a second compiled model (its own graphs and paged KV pool) guesses.

For each target sequence the proposer keeps a draft-side :class:`Sequence` whose computed KV
is the target's tokens as far as the draft has read them. A ``propose`` call first rolls that
back to the longest prefix it shares with the target's tokens now (rejected proposals drop out
here; the tail blocks go back to the draft's pool), then runs one forward over the tokens the
draft has not read (the whole prompt the first time, then the target's last few tokens), and
``k - 1`` batched decode steps, one proposal each. Greedy requests take the draft's argmax;
sampled requests draw from the draft's own distribution (same temperature / top-k / top-p) with
the request's generator and keep it as q for rejection sampling. A sequence stops proposing
once the draft's probability of its next token is below the request's threshold. When the
draft's pool cannot hold a sequence it proposes nothing for it (the target decodes plainly).

Used for ``method="draft"`` (another model, or an INT4 copy of the target) and ``"head"`` (a
view of the target's first layers): both are compiled by ``optimize()`` and handed in as a runner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kv_cache import BlockAllocator
from ..sampling import sampling_probs
from ..step_plan import ScheduledSeq
from ..sequence import Sequence
from .proposer import Draft, DraftRequest

if TYPE_CHECKING:
    from ..runner_protocol import Runner


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    def __init__(self, runner: "Runner", name: str = "draft") -> None:
        self.runner = runner
        self.name = name
        self.block_size = runner.block_size
        self.allocator = BlockAllocator(runner.kv_cache.num_blocks)
        self.seqs: dict[str, Sequence] = {}

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def _blocks(self, n_slots: int) -> int:
        return (n_slots + self.block_size - 1) // self.block_size

    def _sync(self, req: DraftRequest) -> Sequence | None:
        """The draft-side sequence, rolled back to what it shares with the target and with blocks
        for the tokens it will read; None when the pool has no room."""
        target = req.seq
        ds = self.seqs.get(target.request_id)
        if ds is None:
            ds = self.seqs[target.request_id] = Sequence(target.request_id, [], target.params)
            ds.prompt_logprobs = None  # the target scores its prompt; the draft only proposes
        tokens = target.all_ids
        # keep what the draft read of the target's tokens, and leave it at least one to read
        keep = min(ds.num_computed, _common_prefix(ds.all_ids, tokens), len(tokens) - 1)
        ds.prompt_ids, ds.output_ids, ds.num_computed = list(tokens), [], keep
        need = self._blocks(len(tokens) + req.num_tokens - 1)  # the last proposal is never read
        if len(ds.block_table) > need:
            self.allocator.free(ds.block_table[need:])
            del ds.block_table[need:]
        more = need - len(ds.block_table)
        if more > 0:
            if not self.allocator.can_allocate(more):
                self.release(target)
                return None
            ds.block_table.extend(self.allocator.allocate(more, after=ds.block_table[-1] if ds.block_table else None))
        return ds

    def _pick(self, ds: Sequence, row: torch.Tensor, threshold: float) -> tuple[int | None, torch.Tensor | None]:
        """(token, q) from one draft logits row; token None when its probability is below ``threshold``."""
        row = row.float()
        p = ds.params
        if p.greedy:
            tok = int(torch.argmax(row))
            if threshold > 0 and float(torch.softmax(row, -1)[tok]) < threshold:
                return None, None
            return tok, None
        q = sampling_probs(row, p)
        tok = int(torch.multinomial(q, 1, generator=ds.generator))
        if float(q[tok]) < threshold:
            return None, None
        return tok, q

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        live: list[tuple[int, Sequence, DraftRequest]] = []
        for i, r in enumerate(requests):
            ds = self._sync(r)
            if ds is not None:
                ds.generator = r.seq.generator
                live.append((i, ds, r))
        while live:
            items = [ScheduledSeq(ds, ds.num_uncomputed) for _, ds, _ in live]
            logits, owners = self.runner.execute(items)
            for item in items:
                item.seq.num_computed += item.num_tokens
            nxt = []
            for row, o in enumerate(owners):
                i, ds, r = live[o]
                tok, q = self._pick(ds, logits[row], r.threshold)
                if tok is None:
                    continue
                drafts[i].tokens.append(tok)
                if q is not None:
                    probs[i].append(q)
                ds.output_ids.append(tok)
                if len(drafts[i].tokens) < r.num_tokens:
                    nxt.append((i, ds, r))
            live = nxt
        for i, r in enumerate(requests):
            if probs[i] and len(probs[i]) == len(drafts[i].tokens):
                drafts[i].probs = torch.stack(probs[i])
        return drafts

    def release(self, seq) -> None:
        ds = self.seqs.pop(seq.request_id, None)
        if ds is not None and ds.block_table:
            self.allocator.free(ds.block_table)
            ds.block_table = []
