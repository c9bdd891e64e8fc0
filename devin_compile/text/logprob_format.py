"""Token logprobs (:class:`~devin_compile.runtime.logprobs.TokenLogprob`) in OpenAI's two shapes.

- completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``; each ``top_logprobs`` dict holds the k alternatives and the chosen token (as
  OpenAI documents); ``text_offset`` is each token's character offset in the completion text,
  counting token strings (a stream carries the offset on from chunk to chunk);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`` with exactly k alternatives;
- vLLM's ``prompt_logprobs``: per prompt position ``null`` (the first) or
  ``{token id: {"logprob", "rank", "decoded_token"}}`` holding the prompt token and k alternatives.

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

    def completion(self, entries: list, offset: int = 0, k: int | None = None) -> tuple[dict, int]:
        """(the legacy ``logprobs`` object of ``entries``, the text offset after them). An ``int`` entry
        is a token without a logprob (the prompt's first under ``echo``): null logprob and alternatives.
        ``k``: keep each entry's first k alternatives (None: all it has)."""
        tokens, offsets, lps, tops = [], [], [], []
        for e in entries:
            scored = not isinstance(e, int)
            tokens.append(self.piece(e.token_id if scored else e))
            offsets.append(offset)
            offset += len(tokens[-1])
            lps.append(e.logprob if scored else None)
            top = None
            if scored:
                top = {self.piece(t): lp for t, lp in e.top[:k]}
                top.setdefault(tokens[-1], e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def prompt(self, entries: list, k: int) -> list:
        """vLLM's ``prompt_logprobs`` of ``RequestOutput.prompt_logprobs`` (None first), k alternatives each."""
        out: list = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            d = {str(e.token_id): self._ranked(e.token_id, e.logprob, e.rank)}
            for r, (t, lp) in enumerate(e.top[:k]):
                d.setdefault(str(t), self._ranked(t, lp, r + 1))
            out.append(d)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.piece(token_id)}

    def _item(self, token_id: int, logprob: float) -> dict:
        s = self.piece(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def chat(self, entries: list) -> dict:
        """The chat ``logprobs`` object of ``entries``."""
        return {"content": [{**self._item(e.token_id, e.logprob),
                             "top_logprobs": [self._item(t, lp) for t, lp in e.top]} for e in entries]}
