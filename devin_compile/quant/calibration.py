"""Calibration: real-text token chunks and per-input activation statistics.

Data: the calibration set shipped in the package by default, or files and folders
(:mod:`.corpus`, which also cuts the token chunks: calibration from the start of the stream,
evaluation from its end).

Statistics (:func:`collect_stats`), gathered with forward hooks on the Hugging Face model,
one entry per distinct *input* of the decoder's linears (q/k/v share one input, gate/up
another) and of the output head when it is a linear (for ``lm_head=True`` quantization):

- ``hessian`` [K, K] fp32: ``mean(x xᵀ)`` over all calibration tokens (GPTQ's Hessian up to
  a factor 2; also the exact quadratic form of a linear's output error:
  ``E‖ΔW x‖² = tr(ΔW H ΔWᵀ)``, which AWQ's searches and the sensitivities use);
- ``absmean`` [K]: ``mean |x|`` per channel (AWQ's activation scale);
- which norm module produced the input, when it is a norm's output (the place AWQ folds
  its scales into);
- ``fisher`` [N] per linear: ``mean (∂ℓ/∂y_j)²`` over the calibration tokens, the squared
  gradient of the next-token cross-entropy ``ℓ`` (true next tokens) with respect to each
  output channel ``y_j`` (an empirical-Fisher diagonal, from one backward pass per chunk).
  With it a quantization error ``ΔW`` is priced in loss, not just in output error:
  ``Δℓ ≈ ½ Σ_j fisher_j · (ΔW H ΔWᵀ)_jj`` (second order, treating gradient and error as
  independent), which is what mixed precision ranks linears by. ``fisher=False`` skips the
  backward pass; older calibration directories have no ``fisher`` and still load.
- ``grad_hessian`` [K, K] per input, with ``fisher``: ``Σ_t w_t x_t x_tᵀ / Σ_t w_t``, each token
  weighted by ``w_t = Σ ‖∂ℓ/∂y_t‖²`` over the linears reading that input. The loss estimate uses
  it in place of ``hessian``: ``½ Σ_j F_j (ΔW H_g ΔWᵀ)_jj`` is exact when the gradient squares
  factor as ``F_j · (token weight)``, while the plain ``H`` assumes gradient and error independent
  across tokens, which a token with huge activations and almost no gradient breaks (the
  attention-sink first token feeding some ``down_proj``: plain rounding like FP8 errs along it,
  GPTQ fits it away; on SmolLM2 the plain-``H`` estimate priced all-FP8 at 2.3x the token-wise
  value and one linear at 12x).

Saved as ``stats.safetensors`` + ``calib.json`` (:mod:`.calibration_stats`).

Resumable (:func:`collect_stats` with ``checkpoint_dir``): the running sums and the number of
chunks done are written atomically to ``calib.checkpoint.safetensors`` at most every
``checkpoint_every`` seconds (after the chunk that passes it); the same run (model fingerprint,
token chunks, gradients on or off) started again continues from there, any other run ignores it
with a warning, and a finished run deletes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Sequence

import torch

from .corpus import (calibration_and_eval_chunks, load_token_stream,  # noqa: F401  (re-exported)
                     token_chunks)
from .calibration_stats import (FORMAT_VERSION, GRAD_HESSIAN_BITS, HESSIAN_BITS, META_FILE,  # noqa: F401 (re-exported)
                                STATS_FILE, CalibrationStats)
from .model_linears import decoder_linears, model_fingerprint, norm_modules, output_head, quantizable_linears
from .progress import Progress, ProgressArg
from .stats_format import from_upper_triangle, upper_triangle

CHECKPOINT_FILE = "calib.checkpoint.safetensors"


def _norm_producing(x: torch.Tensor, norm_out: dict[int, tuple[torch.Tensor, str]]) -> str | None:
    """The norm whose output ``x`` is, or a token slice of (HF slices the final norm's output to
    the positions that need logits before lm_head): each channel still comes from that norm."""
    n = norm_out.get(id(x))
    if n is not None and n[0] is x:
        return n[1]
    base = x._base
    n = norm_out.get(id(base)) if base is not None else None
    if (n is not None and n[0] is base and x.shape[-1] == base.shape[-1] and x.stride(-1) == base.stride(-1) == 1
            and (x.storage_offset() - base.storage_offset()) % base.shape[-1] == 0):
        return n[1]
    return None


def add_gram(acc: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """``acc += xᵀ y`` for a symmetric result (``y`` is ``x`` or ``x`` with rows reweighted), computing
    only the column blocks at and right of each row block's diagonal block: about 5/8 of the full
    product's work at K = 1536 (4 blocks), 3/4 at K = 576. Entries below the diagonal blocks are
    left untouched; :func:`symmetric_from_upper` completes the matrix once accumulation is over."""
    k = x.shape[1]
    nb = max(1, round(k / 384))
    b = -(-k // nb)
    for a in range(0, k, b):
        acc[a:a + b, a:].addmm_(x[:, a:a + b].t(), y[:, a:])


def symmetric_from_upper(acc: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose upper triangle (with the diagonal) is ``acc``'s."""
    return torch.triu(acc) + torch.triu(acc, 1).t()


class StatsCollector:
    """Accumulates :class:`CalibrationStats` over chunks, from hooks on the linears and norms and, with
    ``gradients``, on the linears' outputs and the input embedding (the autograd graph starts at its
    output: activation gradients only, none for parameters)."""

    def __init__(self, model: torch.nn.Module, gradients: bool):
        # the output head's input too (cheap: one [K, K] Hessian), for quantization with lm_head=True
        self.linears = quantizable_linears(model, lm_head=output_head(model) is not None)
        self.norms = norm_modules(model)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.embedding = emb if isinstance(emb, torch.nn.Module) else None
        self.gradients = gradients and self.embedding is not None
        self.hessian: dict[str, torch.Tensor] = {}
        self.absmean: dict[str, torch.Tensor] = {}
        self.linear_input: dict[str, str] = {}
        self.producer: dict[str, str] = {}
        self.grad_sq: dict[str, torch.Tensor] = {}  # linear name → Σ (∂ℓ/∂y)² per output channel
        self.grad_gram: dict[str, torch.Tensor] = {}  # input key → Σ_t w_t x_t x_tᵀ (upper blocks)
        self.grad_weight: dict[str, float] = {}  # input key → Σ_t w_t
        self.tokens = 0
        self.grad_positions = 0
        # this chunk only
        self._live: dict[int, tuple[torch.Tensor, str]] = {}  # id(input tensor) → (tensor, key)
        self._norm_out: dict[int, tuple[torch.Tensor, str]] = {}
        self._chunk_x: dict[str, torch.Tensor] = {}  # input key → [T, K] input (for the gradient gram)
        self._token_w: dict[str, torch.Tensor] = {}  # input key → [T] Σ ‖∂ℓ/∂y_t‖²
        self._start: torch.Tensor | None = None  # the embedding output, where the autograd graph starts
        self._handles: list = []

    def attach(self) -> None:
        """Register the hooks (:meth:`detach` removes them)."""
        self._handles += [m.register_forward_pre_hook(partial(self._on_linear_input, n))
                          for n, m in self.linears.items()]
        self._handles += [m.register_forward_hook(partial(self._on_norm_output, n)) for n, m in self.norms.items()]
        if self.gradients:
            self._handles += [m.register_forward_hook(partial(self._on_linear_output, n))
                              for n, m in self.linears.items()]
            self._handles.append(self.embedding.register_forward_hook(self._on_embedding_output))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._clear_chunk()

    def _clear_chunk(self) -> None:
        self._live.clear()
        self._norm_out.clear()
        self._token_w.clear()
        self._chunk_x.clear()

    def run_chunk(self, model: torch.nn.Module, ids: torch.Tensor) -> None:
        """One forward over ``ids`` [1, T] (the hooks collect), and with gradients one backward."""
        out = model(input_ids=ids, use_cache=False)
        if self.gradients and ids.shape[1] > 1:
            self._backward(out.logits, ids)
        del out
        self._start = None
        self._clear_chunk()
        self.tokens += ids.numel()

    def _backward(self, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """Backward from the chunk's next-token cross-entropy (summed over positions, so each
        position's gradient is its own loss's), then this chunk's gradient-weighted grams."""
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
        torch.autograd.grad(loss, [self._start])  # the output-gradient hooks collect on the way
        self.grad_positions += ids.shape[1] - 1
        for key, w in self._token_w.items():
            x2 = self._chunk_x[key]
            if key not in self.grad_gram:
                self.grad_gram[key] = torch.zeros(x2.shape[1], x2.shape[1], device=x2.device)
            add_gram(self.grad_gram[key], x2, x2 * w[:, None])
            self.grad_weight[key] = self.grad_weight.get(key, 0.0) + float(w.sum())

    def _on_linear_input(self, name: str, _mod, args) -> None:
        """Accumulate a linear's input, once per distinct input tensor (q/k/v share one)."""
        x = args[0]
        hit = self._live.get(id(x))
        if hit is not None and hit[0] is x:
            key = hit[1]
        else:
            key = name
            self._live[id(x)] = (x, key)
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            if self.gradients:
                self._chunk_x[key] = x2
            a = x2.abs().sum(0)
            if key in self.hessian:
                self.absmean[key] += a
            else:
                kdim = x2.shape[1]
                self.hessian[key], self.absmean[key] = torch.zeros(kdim, kdim, device=x2.device), a
                n = _norm_producing(x, self._norm_out)
                if n is not None:
                    self.producer[key] = n
            add_gram(self.hessian[key], x2, x2)
        prev = self.linear_input.setdefault(name, key)
        if prev != key:
            raise RuntimeError(f"calibration: {name} read a different input on a later chunk ({prev} vs {key})")

    def _on_norm_output(self, name: str, _mod, _args, out) -> None:
        if isinstance(out, torch.Tensor):
            self._norm_out[id(out)] = (out, name)

    def _on_linear_output(self, name: str, _mod, _args, out) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(partial(self._on_output_grad, name))

    def _on_output_grad(self, name: str, g: torch.Tensor) -> None:
        g2 = g.detach().reshape(-1, g.shape[-1]).float().pow(2)
        sq = g2.sum(0)
        key = self.linear_input[name]
        self._token_w[key] = self._token_w[key] + g2.sum(1) if key in self._token_w else g2.sum(1)
        if name in self.grad_sq:
            self.grad_sq[name] += sq
        else:
            self.grad_sq[name] = sq

    def _on_embedding_output(self, _mod, _args, out) -> torch.Tensor:
        self._start = out.detach().requires_grad_(True)
        return self._start

    def checkpoint_state(self, run: str, chunks_done: int, seconds: float) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, state) of the running sums after ``chunks_done`` chunks, tagged with the run key
        ``run`` (:func:`run_key`). Grams keep their upper triangle only (all that
        :func:`symmetric_from_upper` reads), exact fp32 copies."""
        tensors = {f"hessian/{k}": upper_triangle(v.detach().cpu(), 0) for k, v in self.hessian.items()}
        tensors.update({f"grad_gram/{k}": upper_triangle(v.detach().cpu(), 0) for k, v in self.grad_gram.items()})
        tensors.update({f"absmean/{k}": v.detach().cpu().clone() for k, v in self.absmean.items()})
        tensors.update({f"grad_sq/{k}": v.detach().cpu().clone() for k, v in self.grad_sq.items()})
        state = {"run": run, "chunks_done": chunks_done, "seconds": seconds, "tokens": self.tokens,
                 "grad_positions": self.grad_positions, "linear_input": self.linear_input,
                 "producer": self.producer, "grad_weight": self.grad_weight,
                 "order": {"hessian": list(self.hessian), "grad_gram": list(self.grad_gram),
                           "absmean": list(self.absmean), "grad_sq": list(self.grad_sq)}}
        return tensors, state

    def restore(self, tensors: dict[str, torch.Tensor], state: dict, device: torch.device) -> None:
        """Continue from :meth:`checkpoint_state`'s ``tensors`` and ``state``."""
        order = state["order"]
        dims = {k: tensors[f"absmean/{k}"].numel() for k in order["absmean"]}
        self.hessian = {k: from_upper_triangle(tensors[f"hessian/{k}"], dims[k], 0).to(device)
                        for k in order["hessian"]}
        self.grad_gram = {k: from_upper_triangle(tensors[f"grad_gram/{k}"], dims[k], 0).to(device)
                          for k in order["grad_gram"]}
        self.absmean = {k: tensors[f"absmean/{k}"].to(device) for k in order["absmean"]}
        self.grad_sq = {k: tensors[f"grad_sq/{k}"].to(device) for k in order["grad_sq"]}
        self.tokens, self.grad_positions = state["tokens"], state["grad_positions"]
        self.linear_input, self.producer = state["linear_input"], state["producer"]
        self.grad_weight = state["grad_weight"]

    def finish(self, *, num_chunks: int, chunk_len: int, fingerprint: dict, seconds: float,
               data: str) -> CalibrationStats:
        """The means over the tokens seen, as :class:`CalibrationStats`."""
        hessian = {k: (symmetric_from_upper(h) / self.tokens).cpu() for k, h in self.hessian.items()}
        absmean = {k: (a / self.tokens).cpu() for k, a in self.absmean.items()}
        missing = sorted(set(self.linears) - set(self.linear_input))
        if missing:
            raise ValueError(f"calibration: {len(missing)} linears never ran on the calibration text, e.g. {missing[:3]}")
        fisher, grad_hessian = {}, {}
        # all or nothing: a ranking that mixed loss estimates with missing ones would mean nothing
        if self.gradients and self.grad_positions and set(self.grad_sq) == set(self.linears):
            fisher = {n: (self.grad_sq[n] / self.grad_positions).cpu() for n in self.linears}
            grad_hessian = {k: (symmetric_from_upper(self.grad_gram[k]) / max(self.grad_weight[k], 1e-30)).cpu()
                            for k in hessian}
        return CalibrationStats(hessian, absmean, self.linear_input, self.producer, self.tokens, num_chunks,
                                chunk_len, fingerprint, seconds, data, fisher=fisher, grad_hessian=grad_hessian)


def run_key(fingerprint: dict, chunks: Sequence[torch.Tensor], gradients: bool) -> str:
    """What a checkpoint must match to be resumed: the model, every calibration token, gradients."""
    h = hashlib.sha256(json.dumps({"fingerprint": fingerprint, "gradients": gradients}, sort_keys=True).encode())
    for c in chunks:
        h.update(str(tuple(c.shape)).encode())
        h.update(c.detach().to(torch.int64).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], state: dict) -> threading.Thread:
    """Serialize a checkpoint (safetensors, ``state`` as JSON metadata) now and write it to ``path``
    atomically (a temporary file renamed over it) in a started background thread, so calibration
    goes on while the disk works (the write releases the GIL); join the thread before the next."""
    from safetensors.torch import save

    data = save(tensors, metadata={"calibration_checkpoint": json.dumps(state)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")

    def write() -> None:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    thread = threading.Thread(target=write, name="calibration-checkpoint", daemon=False)
    thread.start()
    return thread


def read_checkpoint(path: Path, run: str) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(tensors, state) of the checkpoint at ``path`` when it belongs to run ``run``; otherwise
    None, after a warning saying why it is ignored."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            state = json.loads((f.metadata() or {})["calibration_checkpoint"])
            if state.get("run") != run:
                warnings.warn(f"ignoring calibration checkpoint {path}: it was made by a different run (model, "
                              "calibration tokens or output gradients differ); calibrating from the start",
                              stacklevel=3)
                return None
            return {k: f.get_tensor(k) for k in f.keys()}, state
    except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        warnings.warn(f"ignoring calibration checkpoint {path}: it cannot be read ({e}); calibrating from the start",
                      stacklevel=3)
        return None


def collect_stats(model: torch.nn.Module, chunks: Sequence[torch.Tensor], *,
                  progress: ProgressArg = True, data: str = "", fisher: bool = True,
                  checkpoint_dir: str | os.PathLike | None = None,
                  checkpoint_every: float = 30.0) -> CalibrationStats:
    """Run ``chunks`` through ``model`` and accumulate :class:`CalibrationStats` (see module doc).

    With ``fisher`` each chunk also runs backward from its next-token cross-entropy to gather the
    output-gradient squares (:class:`StatsCollector`). With ``checkpoint_dir`` the running sums
    are checkpointed there after a chunk once ``checkpoint_every`` seconds have passed since the
    last checkpoint (0: after every chunk), a checkpoint of the same run is resumed, and the
    checkpoint is deleted at the end (module doc)."""
    if not chunks:
        raise ValueError("calibration needs at least one chunk of tokens")
    t0 = time.perf_counter()
    if not decoder_linears(model):
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers besides its output head: nothing to quantize")
    collector = StatsCollector(model, gradients=fisher)
    chunk_len = int(chunks[0].numel())
    device = next(model.parameters()).device
    fingerprint = model_fingerprint(model)
    ckpt = None if checkpoint_dir is None else Path(checkpoint_dir) / CHECKPOINT_FILE
    run = run_key(fingerprint, chunks, collector.gradients) if ckpt is not None else ""
    start, before = 0, 0.0
    saved = read_checkpoint(ckpt, run) if ckpt is not None and ckpt.exists() else None
    if saved is not None:
        collector.restore(*saved, device)
        start, before = saved[1]["chunks_done"], saved[1]["seconds"]
        del saved
    bar = Progress(progress, len(chunks), f"calibrating ({len(chunks)} x {chunk_len} tokens)")
    if start:
        bar.update(start, "resumed from checkpoint")
    last, writing = time.perf_counter(), None
    try:
        collector.attach()
        with torch.set_grad_enabled(collector.gradients):
            for i in range(start, len(chunks)):
                collector.run_chunk(model, chunks[i].reshape(1, -1).to(device))
                if ckpt is not None and i + 1 < len(chunks) and time.perf_counter() - last >= checkpoint_every:
                    if writing is not None:
                        writing.join()
                    writing = write_checkpoint(ckpt, *collector.checkpoint_state(
                        run, i + 1, before + time.perf_counter() - t0))
                    last = time.perf_counter()
                bar.update(i + 1)
    finally:
        collector.detach()
        if writing is not None:
            writing.join()
    stats = collector.finish(num_chunks=len(chunks), chunk_len=chunk_len, fingerprint=fingerprint,
                             seconds=before + time.perf_counter() - t0, data=data)
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return stats
