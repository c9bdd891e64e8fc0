"""Token logprobs (:class:`~devin_compile.runtime.logprobs.TokenLogprob`) in OpenAI's two shapes.

- completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``; each ``top_logprobs`` dict holds the k alternatives and the chosen token (as
  OpenAI documents); ``text_offset`` is each token's character offset in the completion text,
  counting token strings (a stream carries the offset on from chunk to chunk);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`` with exactly k alternatives.

A token's string is the tokenizer's decoding of that token alone (a byte-level piece of a
multi-byte character decodes to U+FFFD), ``bytes`` its UTF-8 encoding.
"""
from __future__ import annotations


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        s = self._pieces.get(token_id)
        if s is None:
            s = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return s

    def completion(self, entries: list, offset: int = 0) -> tuple[dict, int]:
        """(the legacy ``logprobs`` object of ``entries``, the text offset after them)."""
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self.piece(e.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        tops = []
        for e in entries:
            top = {self.piece(t): lp for t, lp in e.top}
            top.setdefault(self.piece(e.token_id), e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}, offset

    def _item(self, token_id: int, logprob: float) -> dict:
        s = self.piece(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def chat(self, entries: list) -> dict:
        """The chat ``logprobs`` object of ``entries``."""
        return {"content": [{**self._item(e.token_id, e.logprob),
                             "top_logprobs": [self._item(t, lp) for t, lp in e.top]} for e in entries]}
