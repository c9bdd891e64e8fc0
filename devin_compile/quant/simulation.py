"""The eager counterpart of a compiled quantized model, for tests, evaluation and the ``max_kl`` search."""
from __future__ import annotations

import copy

import torch

from .model_linears import output_head, quantizable_linears
from .result import QuantResult


def simulate(model: torch.nn.Module, result: QuantResult, int4: set[str] | None = None,
             fp8: set[str] | None = None) -> torch.nn.Module:
    """A deep copy of ``model`` with the linears in ``int4`` (default: all but ``fp8``) replaced by
    their dequantized INT4 weights, those in ``fp8`` by their dequantized FP8 weights and the
    others by their full-precision weights, AWQ folds applied: what the compiled model computes,
    in eager PyTorch (for tests and evaluation). An embedding tied to an INT4 head reads the head's dequantized
    rows (AWQ's input scale undone), as the compiled model does; an INT8 head (``int8_head``) replaces the
    head's weight, and with it a tied embedding's."""
    result.check_tensors("simulate()")
    sim = copy.deepcopy(model)
    eight = set(fp8 or ())
    chosen = set(result.linears) - eight if int4 is None else set(int4)
    if chosen & eight:
        raise ValueError(f"simulate: linears both INT4 and FP8, e.g. {sorted(chosen & eight)[:3]}")
    head = result.linears.get(result.head) if result.head in chosen else None
    emb = sim.get_input_embeddings() if hasattr(sim, "get_input_embeddings") else None
    tied = head is not None and head.embedding_readable and emb is not None and emb.weight is output_head(sim)[1].weight
    if result.head is not None:
        untie_head(sim)
    params = dict(sim.named_parameters())
    lins = quantizable_linears(sim, lm_head=result.head is not None)
    with torch.no_grad():
        for pname, value in result.overrides.items():
            params[pname].copy_(value)
        for n, ql in result.linears.items():
            w = lins[n].weight
            w.copy_(ql.dequantized(w.dtype) if n in chosen else ql.fp8_dequantized(w.dtype) if n in eight
                    else ql.fp_weight(w))
        if tied:  # the embedding reads the INT4 head's rows (devin::int4_embedding), AWQ's input scale undone
            emb.weight.copy_(head.embedding_rows().to(emb.weight.dtype))
        if result.int8_head is not None:  # a tied embedding shares the weight: it reads the INT8 rows too
            w = dict(sim.named_modules())[result.int8_head.name].weight
            w.copy_(result.int8_head.dequantized(w.dtype))
    return sim


def untie_head(model: torch.nn.Module) -> None:
    """Give a head tied to the input embedding its own weight (a copy), so writing one leaves the other."""
    head = output_head(model)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and emb is not None and head[1].weight is emb.weight:
        head[1].weight = torch.nn.Parameter(head[1].weight.detach().clone(), requires_grad=False)
