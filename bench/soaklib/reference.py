"""The in-process answers of the plan's checked requests: the same model's engine
(``devin_compile.optimize`` in this process, no server, no KV tier), each distinct request once.

A greedy request's answer is its ``max_tokens`` greedy tokens (EOS ignored); a multi request's choice
``i`` is sampled with ``seed + i`` at its temperature (as the server seeds choices), with its logprobs.
Prompts are tokenised here from the workload text (``add_special_tokens=False``; chat: the tokenizer's
chat template), not by the server.
"""
from __future__ import annotations

from dataclasses import dataclass

from .plan import Item


@dataclass
class Expected:
    texts: list[str]  # per choice
    tokens: list[int]  # tokens per choice
    logprobs: list[list[float]] | None  # the chosen tokens' logprobs per choice (when asked)


def key(item: Item) -> tuple:
    return item.chat, item.prompt, item.max_tokens, item.n, tuple(sorted(item.sampling.items())), item.logprobs


def _prompt_ids(opt, item: Item) -> list[int]:
    if item.chat:
        return opt.chat_ids([{"role": "user", "content": item.prompt}])
    return opt.tokenizer(item.prompt, add_special_tokens=False)["input_ids"]


def _params(item: Item, choice: int):
    from devin_compile import SamplingParams

    sampled = {}
    if item.sampling:
        sampled = dict(do_sample=True, temperature=item.sampling["temperature"], seed=item.sampling["seed"] + choice)
    return SamplingParams(max_new_tokens=item.max_tokens, ignore_eos=True, logprobs=item.logprobs, **sampled)


def reference(opt, plan: list[Item]) -> dict[tuple, Expected]:
    """{:func:`key`: :class:`Expected`} for every checked item of ``plan``, generated in one batch."""
    firsts = {}
    for item in plan:
        if item.checked:
            firsts.setdefault(key(item), item)
    prompts, params, owner = [], [], []
    for k, item in firsts.items():
        ids = _prompt_ids(opt, item)
        for i in range(item.n):
            prompts.append(ids)
            params.append(_params(item, i))
            owner.append(k)
    outs = opt.engine.generate(prompts, params, raise_on_error=True) if prompts else []
    refs = {k: Expected([], [], [] if item.logprobs is not None else None) for k, item in firsts.items()}
    for k, out in zip(owner, outs):
        e = refs[k]
        e.texts.append(opt.tokenizer.decode(out.output_ids, skip_special_tokens=True))
        e.tokens.append(len(out.output_ids))
        if e.logprobs is not None:
            e.logprobs.append([t.logprob for t in out.logprobs])
    return refs
