"""Decode steps by bucket: static input buffers, and on CUDA one CUDA Graph per bucket.

:class:`~.model_runner.ModelRunner` hands each pure-decode step (one token per row, every row
sampled; speculative verify rows included) to a :class:`DecodeGraphs` first. It pads the rows up
to the step's decode bucket (dummy rows: token 0 at position 0, slot -1 so nothing is written, a
one-slot read of block 0) and runs that bucket's replayable; ``None`` means "not here" and the
runner runs the step uncaptured (above the largest bucket, a KV-pruning step, a block table wider
than the static one). Three kinds of replayable:

- ``cuda_graph`` (``Program.cuda_graph_buckets`` on a CUDA runner): per bucket a
  :class:`StaticDecodeInputs` — token ids, positions, logits rows and the attention metadata's
  tensors (query starts, sequence lengths, block tables at a static width, slot mapping) — and one
  ``torch.cuda.CUDAGraph`` of the decode graph captured over them, largest bucket first, every
  bucket in one memory pool. A step copies its values into the buffers (two host→device copies
  from pinned memory) and replays. The metadata's host fields hold static maxima (one query per
  row, ``max_seq_len``), so the captured kernels' grids never depend on a step's values; only
  backends that read nothing else (``cuda_graph_safe = True``: triton, FlashAttention) are
  captured. Captured logits holding NaN/inf are recomputed uncaptured, at most
  ``recompute_depth`` times (rows that stay non-finite fail their request alone in the sampler).
- ``static``: the same buffers, the decode graph run eagerly on them each step: what a replay
  does, without capture (CPU tests of the buffers with the triton interpreter; a CUDA runner with
  a backend that cannot be captured runs uncaptured instead).
- ``callables`` (``Program.decode_callables``: compile_decode's Inductor code on CPU): rows
  padded to the bucket, fresh metadata (CPU kernels read its host lists), the bucket's callable.

Invariant: for every bucket, a step's logits are the uncaptured decode graph's on the same rows
(greedy tokens identical in float32; tests/test_decode_graphs.py).
"""
from __future__ import annotations

import logging

import torch

from ..step import AttentionMetadata, StepContext, decode_bucket, step_context

log = logging.getLogger(__name__)


def pad_rows(n: int, bucket: int, ids, pos, slots, seq_lens, tables):
    """The decode lists padded from ``n`` to ``bucket`` rows with dummy sequences."""
    pad = bucket - n
    return (ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad, seq_lens + [1] * pad, tables + [[0]] * pad)


class StaticDecodeInputs:
    """One bucket's graph inputs and attention metadata, at fixed addresses.

    ``i64`` holds ids | positions | slots, ``i32`` query starts | sequence lengths | block tables
    ``[bucket, width]``; :meth:`fill` writes a step's rows into them (columns past the step's widest
    table keep stale entries, which no kernel reads: a row reads entries below
    ``cdiv(seq_len, block_size)`` only)."""

    def __init__(self, bucket: int, width: int, max_seq_len: int, device: torch.device) -> None:
        self.bucket, self.width, self.device = bucket, width, device
        b = bucket
        self.i64 = torch.zeros(3 * b, dtype=torch.long, device=device)
        self.i32 = torch.zeros(2 * b + 1 + b * width, dtype=torch.int32, device=device)
        self.i32[:b + 1] = torch.arange(b + 1, dtype=torch.int32)
        self.ids = self.i64[:b].view(1, b)
        self.positions = self.i64[b:2 * b].view(1, b)
        self.rows = torch.arange(b, device=device)
        self.tables = self.i32[2 * b + 1:].view(b, width)
        pin = device.type == "cuda"
        self._host64 = torch.zeros(3 * b, dtype=torch.long, pin_memory=pin)
        self._host32 = torch.zeros(b + b * width, dtype=torch.int32, pin_memory=pin)
        self.max_seq_len = max_seq_len

    def metadata(self) -> AttentionMetadata:
        """A fresh metadata over the buffers (a fresh per-step ``scratch``), host fields at their static maxima."""
        b = self.bucket
        return AttentionMetadata(
            query_start_loc=self.i32[:b + 1], seq_lens=self.i32[b + 1:2 * b + 1], block_tables=self.tables,
            slot_mapping=self.i64[2 * b:], max_query_len=1, max_seq_len=self.max_seq_len,
            query_lens_host=[1] * b, seq_lens_host=[self.max_seq_len] * b, has_padded_slots=True)

    def fits(self, tables: list[list[int]]) -> bool:
        return max(len(t) for t in tables) <= self.width

    def fill(self, ids, pos, slots, seq_lens, tables) -> None:
        """Copy one step's rows (``len(ids) <= bucket``; the rest become dummy rows) into the buffers.

        The copies are asynchronous from pinned memory on CUDA: the step's sampler reads the
        logits (a sync) before the next :meth:`fill` rewrites the host buffers."""
        b, n = self.bucket, len(ids)
        ids, pos, slots, seq_lens, tables = pad_rows(n, b, ids, pos, slots, seq_lens, tables)
        w = max(len(t) for t in tables)
        self._host64.copy_(torch.tensor(ids + pos + slots, dtype=torch.long))
        flat = [x for t in tables for x in (t + [0] * (w - len(t)))]
        host32 = self._host32[:b + b * w]
        host32.copy_(torch.tensor(seq_lens + flat, dtype=torch.int32))
        async_ = self.device.type == "cuda"
        self.i64.copy_(self._host64, non_blocking=async_)
        self.i32[b + 1:2 * b + 1].copy_(host32[:b], non_blocking=async_)
        self.tables[:, :w].copy_(host32[b:].view(b, w), non_blocking=async_)

    def fill_dummy(self) -> None:
        """Every row a dummy (writes nothing, reads slot 0 of block 0): the warm-up and capture inputs."""
        self.fill([0], [0], [-1], [1], [[0]])


class DecodeGraphs:
    """The runner's decode steps by bucket (see the module docstring for the three modes)."""

    def __init__(self, program, kv_cache, backend, device: torch.device, *, mode: str, max_seq_len: int,
                 recompute_depth: int = 1) -> None:
        if mode not in ("cuda_graph", "static", "callables"):
            raise ValueError(f"DecodeGraphs(mode={mode!r}): one of 'cuda_graph', 'static', 'callables'")
        self.program, self.kv_cache, self.backend, self.device = program, kv_cache, backend, device
        self.mode = mode
        self.recompute_depth = recompute_depth
        self.recomputes = 0  # captured steps whose logits were not finite, recomputed uncaptured
        self.steps = 0  # decode steps run here (replayed, static or a bucket's callable)
        if mode == "callables":
            self.buckets = tuple(sorted(program.decode_callables))
            return
        self.buckets = tuple(sorted(program.cuda_graph_buckets))
        width = min(kv_cache.num_blocks, -(-max_seq_len // kv_cache.block_size) + 1)
        self.inputs = {b: StaticDecodeInputs(b, width, max_seq_len, device) for b in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if mode == "cuda_graph":
            try:
                self._capture_all()
            except Exception as e:  # noqa: BLE001  (a capture that fails leaves decode uncaptured, said once)
                log.warning("decode runs without CUDA Graphs: capturing bucket failed (%s: %s)", type(e).__name__, e)
                self.graphs.clear()
                self.buckets = ()

    @classmethod
    def for_runner(cls, program, kv_cache, backend, device: torch.device, *, max_seq_len: int,
                   recompute_depth: int = 1) -> "DecodeGraphs | None":
        """What this program and device get: CUDA Graphs where the program asks for them, the device
        is CUDA and the backend is capture-safe; compile_decode's callables; else None."""
        if program.cuda_graph_buckets and device.type == "cuda":
            if getattr(backend, "cuda_graph_safe", False):
                return cls(program, kv_cache, backend, device, mode="cuda_graph", max_seq_len=max_seq_len,
                           recompute_depth=recompute_depth)
            log.warning("decode runs without CUDA Graphs: the %r attention backend reads host-side step values "
                        "(only triton / flash_attn2 / flash_attn3 are capture-safe)", getattr(backend, "name", backend))
        if program.decode_callables:
            return cls(program, kv_cache, backend, device, mode="callables", max_seq_len=max_seq_len)
        return None

    # -- capture ----------------------------------------------------------------
    def _capture_all(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool (smaller buckets
        reuse the largest one's blocks). Runs at engine build, before any request holds KV blocks:
        the dummy rows write nothing, but a backend's writes of padded rows may touch slot 0."""
        pool = torch.cuda.graph_pool_handle()
        fn = self.program.graphs["decode"]
        for b in sorted(self.buckets, reverse=True):
            inp = self.inputs[b]
            inp.fill_dummy()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(2):  # Triton JIT, cuBLAS workspaces, lazy inits: outside the capture
                    self._eager(inp)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), step_context(self._context(inp)):
                with torch.cuda.graph(graph, pool=pool, stream=stream):  # the stream the warm-up ran on
                    out = fn(inp.ids, inp.positions, inp.rows)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def _context(self, inp: StaticDecodeInputs, meta: AttentionMetadata | None = None) -> StepContext:
        return StepContext(meta or inp.metadata(), self.kv_cache, self.backend, None)

    def _eager(self, inp: StaticDecodeInputs, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The decode graph run on the buffers (what a replay computes)."""
        with torch.inference_mode(), step_context(self._context(inp, meta)):
            return self.program.graphs["decode"](inp.ids, inp.positions, inp.rows)

    # -- per step -----------------------------------------------------------------
    def run(self, ids, pos, slots, seq_lens, tables) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """(logits ``[len(ids), vocab]``, the step's metadata) of one decode step, or None: the runner
        runs it uncaptured."""
        n = len(ids)
        bucket = decode_bucket(n, self.buckets)
        if bucket is None or (self.mode != "callables" and not self.inputs[bucket].fits(tables)):
            return None
        self.steps += 1
        if self.mode == "callables":
            return self._run_callable(bucket, ids, pos, slots, seq_lens, tables)
        inp = self.inputs[bucket]
        inp.fill(ids, pos, slots, seq_lens, tables)
        if self.mode == "static":
            meta = inp.metadata()
            return self._eager(inp, meta)[0, :n], meta
        graph, out = self.graphs[bucket]
        graph.replay()
        # the clone: the next replay rewrites ``out``
        return self.recompute_if_not_finite(out[0, :n], inp).clone(), inp.metadata()

    def recompute_if_not_finite(self, logits: torch.Tensor, inp: StaticDecodeInputs) -> torch.Tensor:
        """Replayed ``logits`` of the rows in ``inp``, or, where they hold NaN/inf, the step run again
        uncaptured on the same buffers (at most ``recompute_depth`` times; what is still not finite
        then fails its requests alone in the sampler)."""
        n = logits.shape[0]
        for _ in range(self.recompute_depth):
            if bool(torch.isfinite(logits).all()):
                break
            self.recomputes += 1
            log.warning("a CUDA-Graph decode step (bucket %d) gave non-finite logits; recomputing it uncaptured",
                        inp.bucket)
            logits = self._eager(inp)[0, :n]
        return logits

    def _run_callable(self, bucket: int, ids, pos, slots, seq_lens, tables):
        n = len(ids)
        ids, pos, slots, seq_lens, tables = pad_rows(n, bucket, ids, pos, slots, seq_lens, tables)
        meta = AttentionMetadata.build([1] * bucket, seq_lens, tables, slots, device=self.device)
        dev = self.device
        args = (torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), torch.arange(bucket, device=dev))
        with torch.inference_mode(), step_context(StepContext(meta, self.kv_cache, self.backend, None)):
            return self.program.decode_callables[bucket](*args)[0, :n], meta
