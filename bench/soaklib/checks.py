"""The soak's verdict: each outcome against what its request expects, the server's state and counters
afterwards, resident memory, and the figures (TTFT, inter-token latency, end-to-end percentiles).

:func:`problems` lists what went wrong (empty: the soak passed):

- a checked request (greedy, or n > 1 sampled with logprobs) answered 200 in full, each choice's text
  equal to the in-process one, ``finish_reason`` ``"length"``, ``usage.completion_tokens`` equal, and
  logprobs (when asked) one per token within ``logprob_tol`` of the in-process ones;
- a malformed request got its status (and the error's ``param`` where one is named);
- a cut-off stream was answered 200 and the client left as planned (or the answer ended first);
- afterwards no KV block is held and nothing is queued or running; ``devin_requests_total`` has no
  5xx, and 200 + 499 (client gone) add up to the generating requests;
- resident memory at the end is at most ``(1 + rss_growth)`` times that after warm-up.
"""
from __future__ import annotations

from .driver import SoakRun
from .observe import idle, status_counts
from .plan import Item
from .reference import Expected, key


def _check_generation(item: Item, out, exp: Expected, tol: float) -> list[str]:
    if out.status != 200 or not out.done or out.error:
        return [f"status {out.status}, complete {out.done}, error {out.error!r}"]
    bad = []
    for i in range(item.n):
        if out.texts.get(i) != exp.texts[i]:
            bad.append(f"choice {i}: text {out.texts.get(i)!r} != in-process {exp.texts[i]!r}")
        if out.finish.get(i) != "length":
            bad.append(f"choice {i}: finish_reason {out.finish.get(i)!r}")
        if exp.logprobs is not None:
            got = out.logprobs.get(i, [])
            if len(got) != exp.tokens[i]:
                bad.append(f"choice {i}: {len(got)} logprobs for {exp.tokens[i]} tokens")
            elif any(abs(a - b) > tol for a, b in zip(got, exp.logprobs[i])):
                worst = max(abs(a - b) for a, b in zip(got, exp.logprobs[i]))
                bad.append(f"choice {i}: logprobs differ from in-process by up to {worst:.2e}")
    completion = (out.usage or {}).get("completion_tokens")
    if completion != sum(exp.tokens):
        bad.append(f"usage.completion_tokens {completion} != {sum(exp.tokens)}")
    return bad


def _check_one(item: Item, out, refs: dict, tol: float) -> list[str]:
    if item.kind.startswith("malformed:"):
        if out.status != item.expect_status or (item.expect_param and out.param != item.expect_param):
            return [f"status {out.status} param {out.param!r}, expected {item.expect_status} "
                    f"param {item.expect_param!r} ({out.error})"]
        return []
    if item.kind == "cut":
        if out.status != 200 or out.error or not (out.cut or out.done):
            return [f"status {out.status}, left {out.cut}, complete {out.done}, error {out.error!r}"]
        return []
    return _check_generation(item, out, refs[key(item)], tol)


def problems(plan: list[Item], run: SoakRun, refs: dict, *, rss_growth: float = 0.05,
             logprob_tol: float = 1e-3) -> list[str]:
    """What went wrong in ``run`` (empty: nothing), one line each."""
    bad = []
    for item, out in zip(plan, run.outcomes):
        bad += [f"request {item.index} ({item.kind}, {'chat' if item.chat else 'completions'}"
                f"{', stream' if item.stream else ''}): {p}" for p in _check_one(item, out, refs, logprob_tol)]
    m = run.idle_metrics
    if not idle(m):
        bad.append(f"not idle at the end: {m['devin_kv_blocks_used']:g} KV blocks used, "
                   f"{m['devin_running_sequences']:g} running, {m['devin_queue_requests']:g} queued")
    counts = status_counts(m)
    if any(s.startswith("5") for s in counts):
        bad.append(f"5xx answers: {counts}")
    generating = sum(not it.kind.startswith("malformed:") for it in plan)
    if counts.get("200", 0) + counts.get("499", 0) != generating:
        bad.append(f"server counted {counts} for {generating} generating requests")
    if run.rss_end > (1 + rss_growth) * run.rss_after_warmup:
        bad.append(f"resident memory grew {100 * (run.rss_end / run.rss_after_warmup - 1):.1f}% after warm-up "
                   f"({run.rss_after_warmup >> 20} -> {run.rss_end >> 20} MiB)")
    return bad


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` (nearest rank; None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _ms(xs: list[float]) -> dict:
    return {f"p{round(q * 100)}_ms": None if pct(xs, q) is None else round(1e3 * pct(xs, q), 1)
            for q in (0.5, 0.99)} | {"samples": len(xs)}


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def summary(plan: list[Item], run: SoakRun) -> dict:
    """The soak's figures: requests by kind, answers by status, latency percentiles, memory, faults."""
    kinds: dict[str, int] = {}
    for it in plan:
        k = "malformed" if it.kind.startswith("malformed:") else it.kind
        kinds[k] = kinds.get(k, 0) + 1
    outs = run.outcomes
    streamed = [o for it, o in zip(plan, outs) if it.stream and o.ttft is not None]
    checked = [o for it, o in zip(plan, outs) if it.checked and o.status == 200]
    statuses: dict[str, int] = {}
    for o in outs:
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    m = run.idle_metrics
    return {
        "requests": len(plan), "by_kind": kinds, "client_statuses": dict(sorted(statuses.items())),
        "server_statuses": status_counts(m), "streams_cut": sum(o.cut for o in outs),
        "generated_tokens_checked": sum((o.usage or {}).get("completion_tokens", 0) for o in checked),
        "ttft": _ms([o.ttft for o in streamed]),
        "inter_token": _ms([dt for o in streamed for dt in o.itl]),
        "e2e_checked": _ms([o.e2e for o in checked]),
        "rss_mib": {"after_warmup": mib(run.rss_after_warmup), "end": mib(run.rss_end),
                    "peak": mib(max(b for _, b in run.rss_series + [(0, run.rss_end)])),
                    "growth_pct": round(100 * (run.rss_end / run.rss_after_warmup - 1), 2),
                    "series": [(t, mib(b)) for t, b in run.rss_series]},
        "kv_blocks_used_at_end": m["devin_kv_blocks_used"], "kv_blocks_total": m["devin_kv_blocks_total"],
        "kv_tiers": {k.removeprefix("devin_kv_tier_"): v for k, v in m.items() if k.startswith("devin_kv_tier_")},
        "faults": run.faults, "wall_s": round(run.wall_s, 1), "warmup_s": round(run.warmup_s, 1),
    }
