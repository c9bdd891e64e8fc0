"""Quality of a quantized model against the unquantized one, on fixed token chunks.

For each chunk of ``L`` tokens both models are run teacher-forced (full sequence) and
compared at every position that predicts a next token (``L - 1`` per chunk):

- perplexity: ``exp(mean NLL)`` of the true next token, for each model;
- KL divergence ``KL(p_ref ‖ p_quant)`` over the full vocabulary, mean over positions;
- top-1 agreement: fraction of positions where both argmaxes agree, and the standard error of
  the mean of its per-chunk values (``top1_chunk_se``: how much the figure depends on which chunks
  were read; 0 with one chunk).

``logits_fn`` maps a [1, L] id tensor to [1, L, V] logits (an HF model's ``.logits``, an
``OptimizedModel`` call, ...). Reference logits can be computed once and reused.
:func:`validate` compiles a saved artifact and reports all of these with the weight bytes.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from .corpus import DataArg, load_token_stream, token_chunks
from .progress import Progress, ProgressArg, stage

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def hf_logits_fn(model: torch.nn.Module) -> LogitsFn:
    device = next(model.parameters()).device

    def fn(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()

    return fn


def optimized_logits_fn(opt) -> LogitsFn:
    return lambda ids: opt(ids).logits.float()


@dataclass
class Quality:
    ppl_ref: float
    ppl: float
    kl: float
    top1: float
    tokens: int
    top1_chunk_se: float = 0.0

    @property
    def ppl_increase(self) -> float:
        return self.ppl / self.ppl_ref - 1.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ppl_increase"] = self.ppl_increase
        return d


def reference_logits(logits_fn: LogitsFn, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [logits_fn(c.reshape(1, -1))[0, :-1].float() for c in chunks]


def compare(logits_fn: LogitsFn, chunks: Sequence[torch.Tensor], ref: Sequence[torch.Tensor],
            progress: ProgressArg = False) -> Quality:
    nll_ref = nll = kl = agree = 0.0
    n = 0
    per_chunk = []
    bar = Progress(progress, len(chunks), "evaluating")
    for i, (chunk, r) in enumerate(zip(chunks, ref)):
        q = logits_fn(chunk.reshape(1, -1))[0, :-1].float()
        target = chunk[1:]
        lr, lq = torch.log_softmax(r, -1), torch.log_softmax(q, -1)
        nll_ref += float(-lr.gather(1, target[:, None]).sum())
        nll += float(-lq.gather(1, target[:, None]).sum())
        kl += float((lr.exp() * (lr - lq)).sum())
        same = float((r.argmax(-1) == q.argmax(-1)).sum())
        agree += same
        per_chunk.append(same / target.numel())
        n += target.numel()
        bar.update(i + 1)
    se = float(torch.tensor(per_chunk).std()) / math.sqrt(len(per_chunk)) if len(per_chunk) > 1 else 0.0
    return Quality(math.exp(nll_ref / n), math.exp(nll / n), kl / n, agree / n, n, se)


def validate(model: torch.nn.Module, tokenizer, quantized: str, *, optimize: Callable[..., Any],
             data: DataArg = None, num_chunks: int = 16, chunk_len: int = 512, progress: ProgressArg = True,
             **optimize_options: Any) -> dict:
    """Perplexity (fixed ``chunk_len`` chunks from the end of ``data``), KL vs the unquantized
    model over the full vocabulary, top-1 agreement, weight bytes and the per-layer table of the
    model compiled by ``optimize(model, tokenizer=..., quantized=..., **optimize_options)``
    (pass ``devin_compile.optimize``). ``data``: as for calibration (default: the shipped set, whose
    end calibration never reaches; give held-out text to measure generalisation). ``progress``: over
    the evaluated chunks (:mod:`.progress`; True: log lines, False: silent)."""
    stream = load_token_stream(tokenizer, data)
    chunks = token_chunks(stream, num_chunks, chunk_len, from_end=True, what="evaluation")
    t0 = time.perf_counter()
    stage(progress, f"validate: compiling {quantized}")
    opt = optimize(model, tokenizer=tokenizer, quantized=quantized, **optimize_options)
    compile_s = time.perf_counter() - t0
    stage(progress, f"validate: reference logits of the unquantized model on {num_chunks} x {chunk_len} tokens")
    ref = reference_logits(hf_logits_fn(model), chunks)
    quality = compare(optimized_logits_fn(opt), chunks, ref, progress=progress)
    table = opt.precision_table
    return {"quantized": str(quantized), "quality": quality.as_dict(), "chunks": num_chunks, "chunk_len": chunk_len,
            "int4_bytes_total": sum(r["bytes"] for r in table),  # all quantized tiers (the key predates FP8)
            "precision_counts": {p: sum(r["precision"] == p for r in table) for p in sorted({r["precision"] for r in table})},
            "fp_bytes_total": sum(r["params"] for r in table) * next(model.parameters()).element_size(),
            "compile_seconds": compile_s, "layers": table, "pass_note": opt.quant_note}
