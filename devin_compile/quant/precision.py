"""Which precision each linear gets: INT4, FP8 or the model dtype, from the measured sensitivity.

:func:`choose_int4` is the two-tier choice of the ``all``, ``keep_fp``, ``int4_fraction`` and
``keep`` targets (which linears go to the one tier below the model dtype). :func:`choose_tiers`
adds the byte-budget targets (``memory_bytes=B``, ``memory_fraction=F``: decoder-linear weight
bytes at most B, or F times their bytes in the model dtype), which pick a tier per linear among
``tiers`` (``int4``, ``fp8``) and the model dtype by :func:`knapsack`.

The model: each linear's choice adds its estimated loss increase when that linear alone is
quantized to that tier (0 for the model dtype; ``½ Σ_j F_j (ΔW H_g ΔWᵀ)_jj`` for the tier's
rounding ΔW, ``H_g`` the gradient-weighted input Hessian of :mod:`.calibration`), and the increases add up (second order, errors of different
linears independent). The budget then picks the mix of least total estimated loss that fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Candidate:
    """One graph linear (``node``; the HF linears it computes in ``names``) and, per tier, its
    estimated loss increase and bytes (``fp8_*`` are None/0 when the result has no FP8 weights)."""

    node: Any
    names: list[str]
    n: int
    k: int
    group_size: int
    sensitivity: float  # INT4
    fp_bytes: int
    int4_bytes: int
    fp8_sensitivity: float | None = None
    fp8_bytes: int = 0

    @property
    def params(self) -> int:
        return self.n * self.k

    def options(self, tiers: tuple[str, ...]) -> dict[str, tuple[int, float]]:
        """tier → (bytes, estimated loss increase), the model dtype ("fp") included."""
        out = {"fp": (self.fp_bytes, 0.0)}
        if "int4" in tiers:
            out["int4"] = (self.int4_bytes, self.sensitivity)
        if "fp8" in tiers:
            out["fp8"] = (self.fp8_bytes, self.fp8_sensitivity)
        return out


def choose_int4(cands: list[Candidate], target: dict) -> set[int]:
    """Indices of the candidates to quantize for a two-tier ``target`` (INT4 or the model dtype)."""
    kind, value = target["kind"], target["value"]
    everything = set(range(len(cands)))
    if kind == "all":
        return everything
    if kind == "max_kl":
        raise ValueError("quantization target max_kl must be resolved against the model first "
                         "(quantize_for_optimize / `quantize run` do it: quant.quantize.resolve_max_kl)")
    if kind == "keep":
        wanted = set(value)
        known = {n for c in cands for n in c.names}
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"quantization target keep names linears the model lacks: {unknown[:3]}")
        return {i for i, c in enumerate(cands) if not wanted & set(c.names)}
    if kind == "keep_fp":
        by_sens = sorted(everything, key=lambda i: -cands[i].sensitivity)
        return everything - set(by_sens[: min(value, len(cands))])
    if kind == "int4_fraction":
        total = sum(c.params for c in cands)
        int4 = everything.copy()
        budget = total - value * total  # params that may stay unquantized
        for i in sorted(everything, key=lambda i: -cands[i].sensitivity / cands[i].params):
            if cands[i].params <= budget + 1e-9:
                int4.discard(i)
                budget -= cands[i].params
        return int4
    choice = choose_tiers(cands, target, ("int4",))
    return {i for i, t in enumerate(choice) if t == "int4"}


def choose_tiers(cands: list[Candidate], target: dict, tiers: tuple[str, ...]) -> list[str]:
    """Per candidate its precision: ``"int4"``, ``"fp8"`` or ``"fp"`` (the model dtype).

    Byte-budget targets: the mix of least total estimated loss within the bytes
    (:func:`knapsack`, each linear choosing among ``tiers`` and the model dtype). Other targets
    are two-tier (:func:`choose_int4`) with the lowest of ``tiers`` (INT4, else FP8) as the
    quantized tier."""
    kind, value = target["kind"], target["value"]
    if kind in ("memory_bytes", "memory_fraction"):
        opts = [c.options(tiers) for c in cands]
        names = [list(o) for o in opts]
        limit = value if kind == "memory_bytes" else value * sum(c.fp_bytes for c in cands)
        need = sum(min(b for b, _ in o.values()) for o in opts)
        if need > limit:
            lowest = "/".join(t.upper() for t in tiers)
            raise ValueError(f"quantization target {kind}={value}: even the smallest tier ({lowest}) for every "
                             f"decoder linear needs {need} bytes, over the budget of {int(limit)} bytes")
        picks = knapsack([list(o.values()) for o in opts], int(limit))
        return [names[i][j] for i, j in enumerate(picks)]
    low = "int4" if "int4" in tiers else "fp8"
    if low == "fp8":  # the two-tier targets rank by the FP8 tier's own sensitivity and bytes
        cands = [Candidate(c.node, c.names, c.n, c.k, c.group_size, c.fp8_sensitivity, c.fp_bytes, c.fp8_bytes)
                 for c in cands]
    chosen = choose_int4(cands, target)
    return [low if i in chosen else "fp" for i in range(len(cands))]


def knapsack(items: list[list[tuple[int, float]]], budget: int, cells: int = 1 << 15) -> list[int]:
    """Multiple-choice knapsack: for each item one option ``(bytes, loss)``, least total loss with
    total bytes at most ``budget`` → the chosen option's index per item.

    Dynamic programming over the bytes above the all-smallest choice, in ``cells`` steps of
    ``u = ceil(spare / cells)`` bytes; each option's extra bytes are rounded *up* to whole steps,
    so the answer always fits the budget and is optimal up to that rounding (at most one step,
    ~spare/32768, per item). O(items x options x cells) in vectorised torch."""
    base = [min(b for b, _ in opts) for opts in items]
    spare = budget - sum(base)
    if spare < 0:
        raise ValueError(f"knapsack: the smallest options need {sum(base)} bytes, over the budget of {budget}")
    unit = max(1, math.ceil(spare / cells))
    cap = spare // unit
    best = torch.zeros(cap + 1, dtype=torch.float64)  # least loss using at most c steps
    picks = []
    for opts, b0 in zip(items, base):
        new = torch.full_like(best, math.inf)
        arg = torch.zeros(cap + 1, dtype=torch.int8)
        for j, (b, loss) in enumerate(opts):
            w = math.ceil((b - b0) / unit)
            if w > cap:
                continue
            cand = torch.full_like(best, math.inf)
            cand[w:] = best[: cap + 1 - w] + loss
            better = cand < new
            new = torch.where(better, cand, new)
            arg[better] = j
        best = new
        picks.append(arg)
    out, c = [], cap
    for opts, b0, arg in zip(reversed(items), reversed(base), reversed(picks)):
        j = int(arg[c])
        out.append(j)
        c -= math.ceil((opts[j][0] - b0) / unit)
    return out[::-1]
