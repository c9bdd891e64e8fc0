"""Incremental detokenisation: token ids in, text deltas out, correct for byte-level BPE.

:class:`IncrementalDetokenizer` decodes a short window of ids (``prefix`` tokens already
shown plus the new ones) and emits only the text past the prefix's; text that ends in an
incomplete UTF-8 sequence (``"\\ufffd"`` at the end) is held back until the next token
completes the character, so no delta ever carries half a character. The prefix window also
keeps tokenizers that drop a leading space when decoding a lone token (SentencePiece ``▁``)
right. ``finish()`` flushes whatever is held back (a sequence that really ends mid-character).

:class:`StopStrings` cuts text at the first stop string, which may span any number of
tokens, and holds back a tail that could still become one; the stop string itself is never
emitted. Invariant: the concatenated deltas equal ``tokenizer.decode(ids)`` cut at the first
stop string.
"""
from __future__ import annotations

from typing import Sequence as Seq

_PROMPT_CONTEXT = 6  # prompt tokens decoded with the first new ones (leading-space handling)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Seq[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        if self.ids and self._decode(self.ids).endswith("\ufffd"):
            self.ids = []  # the prompt ends mid-character: the new text starts its own bytes
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Seq[int]) -> str:
        """The text that ``new_ids`` complete (may be ``""`` while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back for an incomplete character (shown as U+FFFD, as ``decode`` does)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


class StopStrings:
    """Cut a growing text at the first of ``stops``; ``add`` returns what is safe to show."""

    def __init__(self, stops: Seq[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.pending = ""  # text received but not yet shown (could start a stop string)
        self.stopped = False
        self.matched: str | None = None

    def add(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            self.stopped, self.matched, self.pending = True, s, ""
            return buf[:i]
        keep = self._partial_tail(buf)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(self.longest - 1, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def finish(self) -> str:
        """At the end of generation the held-back tail was no stop string after all: show it."""
        if self.stopped:
            return ""
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """Detokeniser + stop strings for one sequence: ``add(ids)`` → delta, ``finish()`` → last delta."""

    def __init__(self, tokenizer, prompt_ids: Seq[int] = (), stop: Seq[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stops = StopStrings(stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def add(self, new_ids: Seq[int]) -> str:
        out = self.stops.add(self.detok.add(new_ids))
        self.text += out
        return out

    def finish(self) -> str:
        out = self.stops.add(self.detok.finish()) if not self.stopped else ""
        out += self.stops.finish()
        self.text += out
        return out
