"""The soak's request plan: which request goes out, in which order, and what it must get back.

Requests draw their prompts (and ``max_new_tokens``, capped) from workload rows
(``{"id", "prompt", "max_new_tokens", "prompt_tokens"}``), so lengths are mixed and prompts repeat
(prefix-cache and KV-tier hits). The fault mix is exact, not drawn: of ``requests``,
``round(disconnect * requests)`` are streams the client leaves after 0-3 content chunks,
``round(malformed * requests)`` are malformed bodies (:mod:`.malformed`, in turn), at least one (when
``multi`` > 0) asks for ``n`` of 2-3 sampled choices with a seed and logprobs, and the rest are greedy;
the kinds are then shuffled by ``seed``. Half of the requests (``chat``) go to chat, half of the
greedy and multi ones stream. Every generating request sends ``ignore_eos``, so a completed one has
exactly ``max_tokens`` tokens per choice.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from .malformed import MAKERS


@dataclass(frozen=True)
class Mix:
    """Shares of the requests: ``disconnect`` (streams cut off), ``malformed``, ``multi`` (n > 1 with
    logprobs); ``stream`` and ``chat``: shares of the others that stream, and of all that go to chat."""

    disconnect: float = 0.20
    malformed: float = 0.05
    multi: float = 0.03
    stream: float = 0.5
    chat: float = 0.5

    def __post_init__(self) -> None:
        shares = (self.disconnect, self.malformed, self.multi, self.stream, self.chat)
        if not all(0 <= s <= 1 for s in shares) or self.disconnect + self.malformed + self.multi > 1:
            raise ValueError(f"{self}: shares must be in [0, 1], and disconnect + malformed + multi <= 1")


@dataclass
class Item:
    """One request of the plan and what it must get."""

    index: int
    kind: str  # "greedy", "cut", "multi" or "malformed:<maker>"
    chat: bool
    stream: bool
    payload: bytes  # the body as sent
    prompt: str
    max_tokens: int
    n: int = 1
    sampling: dict = field(default_factory=dict)  # temperature, seed (multi); empty: greedy
    logprobs: int | None = None  # top alternatives asked for (multi)
    cut_after: int | None = None  # content chunks read before leaving (cut)
    expect_status: int = 200
    expect_param: str | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def checked(self) -> bool:
        """Its answer is compared with the in-process one (it generates and is not cut off)."""
        return self.kind in ("greedy", "multi")


def load_rows(paths, max_prompt_tokens: int | None = None) -> list[dict]:
    """Rows of the workload files, those with at most ``max_prompt_tokens`` prompt tokens."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if max_prompt_tokens is None or r["prompt_tokens"] <= max_prompt_tokens]
    if not rows:
        raise ValueError(f"no workload row of {list(paths)} has at most {max_prompt_tokens} prompt tokens")
    return rows


def body(model: str, prompt: str, chat: bool, max_tokens: int, stream: bool, **extra) -> dict:
    """A generating request's body (greedy unless ``extra`` says otherwise, EOS ignored)."""
    out = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    out["messages" if chat else "prompt"] = [{"role": "user", "content": prompt}] if chat else prompt
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    out.update(extra)
    return out


def _kinds(requests: int, mix: Mix, rng: random.Random) -> list[str]:
    n_cut, n_bad = round(mix.disconnect * requests), round(mix.malformed * requests)
    n_multi = max(1 if mix.multi > 0 else 0, round(mix.multi * requests))
    n_greedy = requests - n_cut - n_bad - n_multi
    if n_greedy < 0:
        raise ValueError(f"{requests} requests are too few for the mix {mix}")
    kinds = ["cut"] * n_cut + ["multi"] * n_multi + ["greedy"] * n_greedy
    kinds += [f"malformed:{MAKERS[i % len(MAKERS)].__name__}" for i in range(n_bad)]
    rng.shuffle(kinds)
    return kinds


def build_plan(rows: list[dict], requests: int, model: str, *, max_tokens: int, seed: int = 0,
               mix: Mix = Mix(), max_body: int = 1 << 20) -> list[Item]:
    """``requests`` items over ``rows``; ``max_tokens`` caps each row's ``max_new_tokens`` (cut-off streams
    ask for ``max_tokens`` itself, so they are still streaming when the client leaves)."""
    rng = random.Random(seed)
    makers = {m.__name__: m for m in MAKERS}
    plan = []
    for i, kind in enumerate(_kinds(requests, mix, rng)):
        row, chat = rng.choice(rows), rng.random() < mix.chat
        prompt, mt = row["prompt"], max(1, min(int(row["max_new_tokens"]), max_tokens))
        item = Item(i, kind, chat, rng.random() < mix.stream, b"", prompt, mt)
        if kind == "cut":
            item.stream, item.max_tokens, item.cut_after = True, max_tokens, rng.randint(0, 3)
        elif kind == "multi":
            item.n, item.logprobs = rng.choice([2, 3]), 2
            item.sampling = {"temperature": 0.8, "seed": rng.randrange(1 << 20)}
        elif kind != "greedy":
            item.stream = False  # malformed: answered before anything streams
        extra = {"n": item.n, **item.sampling} if kind == "multi" else {}
        if item.logprobs is not None:
            extra.update({"logprobs": True, "top_logprobs": item.logprobs} if chat else {"logprobs": item.logprobs})
        b = body(model, prompt, chat, item.max_tokens, item.stream, **extra)
        if kind.startswith("malformed:"):
            item.payload, item.expect_status, item.expect_param = makers[kind.split(":", 1)[1]](b, chat, max_body)
        else:
            item.payload = json.dumps(b).encode()
        plan.append(item)
    return plan
