"""pipeline_offload: keep chosen modules of an eager HF model on the CPU, the rest on the accelerator.

``pipeline_offload(model, offload_layers=["embed_tokens", "lm_head"])`` moves each named
module (matched by its attribute name anywhere in the model) to the CPU and wraps it so
its inputs move to the CPU and its outputs back to the device of the model's other
parameters; ``model.generate()`` and ``model(...)`` work unchanged. Tied modules share one
weight, so offloading one of them offloads both (they stay tied). For the compiled
engine the same placement is the ``offload_embeddings`` pass
(``optimize(model, offload_layers=[...])``).
"""
from __future__ import annotations

import torch

from .passes.offload_embeddings import check_offload_layers


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def pipeline_offload(model: torch.nn.Module, offload_layers=("embed_tokens", "lm_head")) -> torch.nn.Module:
    """Place ``offload_layers`` on the CPU (in place); returns the model. Unknown names →
    ``ValueError`` listing the valid ones. Returns a dict of bytes moved in ``model._devin_offload``."""
    check_offload_layers(model, list(offload_layers))
    wanted = set(offload_layers)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    targets = []
    for name, mod in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in wanted or (tied and (mod is emb or mod is head) and {"embed_tokens", "lm_head"} & wanted):
            targets.append((name, mod))
    device = next(p.device for n, p in model.named_parameters()
                  if not any(n.startswith(t + ".") for t, _ in targets))
    moved = {}
    for name, mod in targets:
        moved[name] = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=True))
        mod.to("cpu")
        mod.register_forward_pre_hook(lambda m, args, kwargs: (_to(args, "cpu"), _to(kwargs, "cpu")), with_kwargs=True)
        mod.register_forward_hook(lambda m, args, out: _to(out, device))
    if tied:  # one tensor: count it once
        seen, total = set(), 0
        for _, mod in targets:
            for p in mod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        moved["total_unique"] = total
    model._devin_offload = moved
    return model
