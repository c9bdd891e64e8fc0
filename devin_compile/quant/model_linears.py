"""The linears calibration and quantization work on, and the fingerprint that ties statistics and
artifacts to one model's weights."""
from __future__ import annotations

import hashlib

import torch


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` of the model except the output head (lm_head, tied or not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def output_head(model: torch.nn.Module) -> tuple[str, torch.nn.Linear] | None:
    """(module name, module) of the model's output head (lm_head) when it is an ``nn.Linear``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        return next(((n, m) for n, m in model.named_modules() if m is head), None)
    return None


def quantizable_linears(model: torch.nn.Module, lm_head: bool = False) -> dict[str, torch.nn.Linear]:
    """The decoder linears, plus the output head when ``lm_head`` (an error if it is not a linear)."""
    lins = decoder_linears(model)
    if lm_head:
        head = output_head(model)
        if head is None:
            raise ValueError(f"{type(model).__name__} has no nn.Linear output head to quantize: "
                             "use lm_head=False")
        lins[head[0]] = head[1]
    return lins


def norm_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """RMSNorm-style modules (``y = weight * normalize(x)``) whose weight AWQ may divide by a scale."""
    out = {}
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        if type(m).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1:
            if "gemma" in type(m).__name__.lower():  # y = (1 + w) * normalize(x): not a plain scale
                continue
            out[n] = m
    return out


def model_fingerprint(model: torch.nn.Module) -> dict:
    """Identifies a model's weights independently of dtype: config shape facts plus a hash of
    each decoder linear's shape and first row (rounded to bf16)."""
    cfg = model.config
    h = hashlib.sha256()
    for name, lin in decoder_linears(model).items():
        w = lin.weight.detach()
        h.update(name.encode())
        h.update(str(tuple(w.shape)).encode())
        h.update(w[0, : min(64, w.shape[1])].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return {"model_type": getattr(cfg, "model_type", type(model).__name__),
            "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
            "hidden_size": getattr(cfg, "hidden_size", None),
            "vocab_size": getattr(cfg, "vocab_size", None),
            "weights_sha256": h.hexdigest()}


def check_fingerprint(expected: dict, model: torch.nn.Module, what: str) -> None:
    got = model_fingerprint(model)
    diffs = [f"{k}: {what} has {expected.get(k)!r}, model has {got[k]!r}" for k in got if expected.get(k) != got[k]]
    if diffs:
        raise ValueError(f"{what} was made for a different model ({'; '.join(diffs[:3])}); make one for this model "
                         "with `devin-compile quantize calibrate` and `quantize run` given its --model")
