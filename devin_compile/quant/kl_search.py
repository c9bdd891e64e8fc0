"""A ``max_kl`` target becomes ``keep_fp=N``: the fewest most-sensitive linear groups kept in the
model dtype for which the quantized model stays within the KL budget (measured in eager PyTorch)."""
from __future__ import annotations

import torch

from .evaluate import compare, hf_logits_fn, reference_logits
from .result import QuantResult, sensitivity
from .simulation import simulate


def resolve_max_kl(model: torch.nn.Module, result: QuantResult, chunks, max_kl: float) -> dict:
    """Turn a ``max_kl`` target into ``keep_fp=N``: the fewest most-sensitive linear groups kept in
    the model dtype for which the eager simulation's mean KL against ``model`` on ``chunks``
    (calibration text) is at most ``max_kl`` (binary search over N; KL falls as N grows)."""
    groups = result.groups or [[n] for n in result.linears]
    sens, _kind = sensitivity(result, groups)
    order = sorted(range(len(groups)), key=lambda i: -sens[i])
    ref = reference_logits(hf_logits_fn(model), chunks)

    def kl_keeping(n: int) -> float:
        keep = {name for i in order[:n] for name in groups[i]}
        sim = simulate(model, result, int4=set(result.linears) - keep)
        return compare(hf_logits_fn(sim), chunks, ref).kl

    lo, hi = 0, len(groups)
    measured = {}
    while lo < hi:
        mid = (lo + hi) // 2
        measured[mid] = kl_keeping(mid)
        if measured[mid] <= max_kl:
            hi = mid
        else:
            lo = mid + 1
    head8 = result.int8_head is not None  # an INT8 output head is outside the target: its KL stays
    kl = measured[lo] if lo in measured else 0.0 if lo == len(groups) and not head8 else kl_keeping(lo)
    note = (f"target max_kl={max_kl}: keep_fp={lo} of {len(groups)} linear groups "
            f"(KL {kl:.4f} on {len(chunks)} calibration chunks)")
    if kl > max_kl:
        note += "; the INT8 output head alone exceeds it: lm_head=False keeps the head in the model dtype"
    result.notes.append(note)
    return {"kind": "keep_fp", "value": lo}
