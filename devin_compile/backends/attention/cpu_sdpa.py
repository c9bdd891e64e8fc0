"""CPU fast path: a C kernel for decode rows, PyTorch's fused CPU SDPA kernels for the rest.

- Decode rows (one query per sequence, in pure-decode and in mixed steps) go to the C
  kernel of :mod:`.cpu_paged_decode`: one call per layer for all of them, K/V read
  straight from the pool in the cache's dtype, float32 arithmetic, no padding.
  Where it cannot be built (no C compiler), one sequence on consecutive blocks attends
  with two float32 GEMMs over [Hkv, G, ·] views of the cache, and several sequences are
  cut into length groups (:mod:`.length_groups`), each gathered in one ``index_select``
  and run as one float32 SDPA call with a key-padding mask.
- A sequence with no cached context (a fresh prefill) attends over its own new
  k/v directly with ``is_causal=True``: no gather at all.
- Anything else (chunked prefill over cached context, sliding windows) gathers that
  sequence's slots and runs SDPA with an explicit mask.
- Calls with ALiBi slopes or attention sinks (decode rows included: the C decode kernel has
  neither) run per sequence through one float32 SDPA call with a float mask
  (:mod:`.cpu_masked`: the bias, ``-inf`` on hidden slots, the sink as an extra zero key).
- Chunked attention (``attention_chunk``) takes the masked path of sliding windows: the C decode
  kernel and the C++ op kernel decline it too.
Soft-capped logits are declined (SDPA has no soft-cap) and go to the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...step import AttentionMetadata, add_step_hook
from . import cpu_paged_decode
from .kv_write import gather_sequence, write_kv
from .length_groups import group_by_length
from .registry import register_backend
from .cpu_masked import forward_masked
from .torch_reference import visible_mask


def _sdpa(q, k, v, *, scale, mask=None, causal=False):
    """q [Hq, Lq, D], k/v [Hkv, Lk, D] (or with a leading batch dim).

    3-D inputs with many queries get a batch dim first: SDPA on 3-D tensors misses the fused
    flash kernel, which is 3.6x faster on a 512-token causal prefill (9/3 heads, bf16). With
    few queries (a decode row inside a mixed step) the flash kernel is the slow one, so those
    stay 3-D (measured end to end on mixed-16: 94 vs 56 generated tok/s).
    """
    if q.dim() == 3 and q.shape[-2] >= 16:
        return _sdpa(q[None], k[None], v[None], scale=scale, mask=mask, causal=causal)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[-3] != k.shape[-3])


def _decode_plan(meta: AttentionMetadata, block_size: int, device: torch.device, rows: list[int]):
    """How this step's decode rows read the cache, computed once per step for all layers.

    ``rows``: the sequences with one query this step. Returns ("range", start, length)
    when it is a single sequence on consecutive blocks (a plain view of the cache, no
    copy), else ("groups", [(token_rows, flat_slots, mask, n, L), ...]): the rows cut
    into length groups (:func:`group_by_length`) so the gathered rectangles stay close
    to the real key count; ``token_rows`` index q/out, ``flat_slots`` [n*L] the cache.
    """
    plan = meta.scratch.get("cpu_decode")
    if plan is not None:
        return plan
    lens = [meta.seq_lens_host[b] for b in rows]
    tables = [meta.block_tables_host[b] for b in rows]
    if len(rows) == 1:
        L = lens[0]
        t = tables[0][: (L + block_size - 1) // block_size]
        if all(b - a == 1 for a, b in zip(t, t[1:])):
            plan = ("range", t[0] * block_size, L)
            meta.scratch["cpu_decode"] = plan
            return plan
    qstart = [0]
    for n in meta.query_lens_host:
        qstart.append(qstart[-1] + n)
    grouping = group_by_length(lens)
    groups = []
    for g in grouping.groups:
        L = lens[g[0]]
        nblk = (L + block_size - 1) // block_size
        table = torch.tensor([tables[i][:nblk] + [0] * (nblk - min(nblk, len(tables[i]))) for i in g],
                             dtype=torch.long, device=device)
        slots = torch.arange(L, device=device)
        flat = table[:, slots // block_size] * block_size + slots % block_size  # [n, L]
        glens = torch.tensor([max(1, lens[i]) for i in g], device=device)
        mask = None
        if int(glens.min()) != L:
            mask = (slots[None, :] < glens[:, None]).view(len(g), 1, 1, L)
        tok_rows = [qstart[rows[i]] for i in g]
        # None: the group is every token of the step, in order (no q gather, no out scatter).
        tok = None if tok_rows == list(range(qstart[-1])) else torch.tensor(tok_rows, dtype=torch.long, device=device)
        groups.append((tok, flat, glens, mask, len(g), L))
    plan = ("groups", groups)
    meta.scratch["cpu_decode"] = plan
    # length-aware grouping's padding, per step (the runner sums it into its stats)
    meta.scratch["attention_padding"] = (grouping.real_tokens, grouping.padded_tokens)
    return plan


def _kernel_plan(meta: AttentionMetadata, rows: list[int], device: torch.device):
    """(q/out row of each decode sequence, their block tables, their lengths, keys per task) for
    the C kernel, built once per step and shared by every layer."""
    plan = meta.scratch.get("cpu_decode_kernel")
    if plan is not None:
        return plan
    if len(rows) == meta.num_seqs:  # pure decode: sequence b is token row b
        plan = (torch.arange(len(rows), device=device), meta.block_tables.contiguous(), meta.seq_lens.contiguous())
    else:
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        plan = (meta.query_start_loc.index_select(0, idx).long(), meta.block_tables.index_select(0, idx).contiguous(),
                meta.seq_lens.index_select(0, idx).contiguous())
    real = sum(meta.seq_lens_host[b] for b in rows)
    plan = (*plan, cpu_paged_decode.chunk_for(real))
    meta.scratch["cpu_decode_kernel"] = plan
    meta.scratch["attention_padding"] = (real, real)  # the kernel reads exactly the cached keys
    return plan


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, rows: list[int],
            out: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence in ``rows``, attention in float32 (faster here than bf16 and
    more accurate). Writes into ``out`` ([T, Hq, Dv], token rows of ``rows``) or, when
    ``out`` is None (a pure-decode step), returns a new [B, Hq, Dv].

    The C kernel when it is built. Otherwise (torch only): one sequence on consecutive
    blocks uses two batched GEMMs over [Hkv, G, ·] views of the cache (GQA without repeats,
    no copy), which beat the fused SDPA kernel, slow in bf16 at one query, by 8x at 500
    cached tokens and 18x at 3000; several sequences run per length group: one gather,
    then fused SDPA in float32.
    """
    if _kernel_supported(q, k_cache, v_cache, meta):
        tok, tables, lens, chunk = _kernel_plan(meta, rows, q.device)
        if out is None:
            out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
        return cpu_paged_decode.decode_attention(q, k_cache, v_cache, tok, tables, lens, scale, out, chunk=chunk)
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    plan = _decode_plan(meta, k_cache.shape[1], q.device, rows)
    kc = k_cache.view(-1, Hkv, k_cache.shape[-1])
    vc = v_cache.view(-1, Hkv, v_cache.shape[-1])
    if plan[0] == "range":
        _, start, L = plan
        row = meta.query_lens_host[: rows[0]]
        t = sum(row)
        kk = kc[start:start + L].permute(1, 2, 0)  # [Hkv, D, L], a view
        vv = vc[start:start + L].transpose(0, 1)  # [Hkv, L, Dv]
        # float32 GEMMs: on this CPU they beat bf16 ones at these skinny shapes, even with the casts.
        scores = torch.bmm(q[t].reshape(Hkv, G, D).float(), kk.float())
        probs = torch.softmax(scores.mul_(scale), dim=-1)
        o = torch.bmm(probs, vv.float()).view(1, Hq, -1).to(q.dtype)
        if out is None:
            return o
        out[t] = o[0]
        return out
    # Gather each group's slots once, cast to float32 (a contiguous copy), and let the fused
    # SDPA kernel read K/V through strided [n, Hkv, L, D] views with a key-padding mask.
    # 3.7x faster than head-group GEMMs over permuted copies at 16 sequences x 300 tokens.
    for tok, flat, lens, mask, n, L in plan[1]:
        qq = q if tok is None else q.index_select(0, tok)
        kk = kc.index_select(0, flat.flatten()).float().view(n, L, Hkv, D).transpose(1, 2)
        vv = vc.index_select(0, flat.flatten()).float().view(n, L, Hkv, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qq.float().view(n, Hq, 1, D), kk, vv, attn_mask=mask, scale=scale,
                                           enable_gqa=G > 1).view(n, Hq, -1).to(q.dtype)
        if tok is None:
            return o
        if out is None:
            out = q.new_empty((q.shape[0], Hq, v_cache.shape[-1]))
        out.index_copy_(0, tok, o)
    return out


def _write(k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
    """This step's K/V into the pool: one C call where the kernel takes them (asked once per step:
    every layer's K/V have the same layout), else the torch path."""
    if _once_per_step(meta, "cpu_write_supported", lambda: cpu_paged_decode.write_supported(k, v, k_cache, v_cache)):
        cpu_paged_decode.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        write_kv(k, v, k_cache, v_cache, meta)


def _kernel_supported(q, k_cache, v_cache, meta: AttentionMetadata) -> bool:
    """Whether the C decode kernel takes this step's tensors (the same for every layer: asked once)."""
    return _once_per_step(meta, "cpu_decode_supported", lambda: cpu_paged_decode.supports(q, k_cache, v_cache))


def _once_per_step(meta: AttentionMetadata, key: str, supported) -> bool:
    """The C library is built and ``supported()``, asked on the step's first layer and kept in
    ``meta.scratch[key]`` for the others (every layer's tensors have the same layout)."""
    ok = meta.scratch.get(key)
    if ok is None:
        ok = meta.scratch[key] = cpu_paged_decode.load() is not None and supported()
    return ok


def _layer_op_plan(q, k, v, k_cache, v_cache, meta: AttentionMetadata):
    """(rows, tables, lens, chunk) for ``devin::cpu_decode_layer`` when this step is pure decode
    and the C kernels take its tensors, else None; decided on the step's first layer and kept
    in ``meta.scratch`` for the others (every layer's tensors have the same layout)."""
    plan = meta.scratch.get("cpu_decode_layer")
    if plan is None:
        ok = (all(n == 1 for n in meta.query_lens_host) and _kernel_supported(q, k_cache, v_cache, meta)
              and _once_per_step(meta, "cpu_write_supported", lambda: cpu_paged_decode.write_supported(k, v, k_cache, v_cache))
              and _load_native_path())
        plan = meta.scratch["cpu_decode_layer"] = _kernel_plan(meta, list(range(meta.num_seqs)), q.device) if ok else False
    return plan or None


_NO_TENSOR = torch.empty(0, dtype=torch.long)
_NO_LENS = torch.empty(0, dtype=torch.int32)
_NO_TABLE = torch.empty((0, 0), dtype=torch.int32)


def _native_plan(ctx):
    """(pool, rows, tables, lens, chunk) when ``devin::paged_attention``'s C++ kernel can serve this
    step's layers: this backend, every sequence with one query, no attention-mass side output
    (KV pruning's evaluation steps keep the Python path), a CPU pool in a dtype the C kernels take;
    else None. Each call is checked again in C++ (dtypes, layouts, no soft-cap or window)."""
    meta = ctx.attn
    step = ctx.kv_prune
    pool = getattr(ctx.kv_cache, "data", None)
    if (not isinstance(ctx.backend, CpuSdpaBackend) or meta.num_seqs == 0
            or not all(n == 1 for n in meta.query_lens_host) or (step is not None and step.side_output)
            or pool is None or pool.device.type != "cpu" or pool.dim() != 6 or pool.shape[1] != 2
            or pool.dtype not in cpu_paged_decode._DTYPES or pool.stride(-1) != 1):
        return None
    return (pool, *_kernel_plan(meta, list(range(meta.num_seqs)), pool.device))


def _push_step(ctx) -> None:
    """Step hook (enter): push this step to the C++ kernel, with its plan when :func:`_native_plan`
    gives one, else inactive (so a nested step never runs on an outer step's state)."""
    plan = _native_plan(ctx)
    if plan is None:
        torch.ops.devin.cpu_decode_step_push(None, _NO_TENSOR, _NO_TENSOR, _NO_TABLE, _NO_LENS, 0)
    else:
        pool, rows, tables, lens, chunk = plan
        torch.ops.devin.cpu_decode_step_push(pool, ctx.attn.slot_mapping, rows, tables, lens, chunk)


def _pop_step(ctx) -> None:
    """Step hook (exit): pop the step; ``scratch["native_decode_layers"]``: how many layers ran in C++."""
    ctx.attn.scratch["native_decode_layers"] = torch.ops.devin.cpu_decode_step_pop()


def _load_native_path() -> bool:
    """Build/load the C++ ops and install the step hooks once; False where they cannot be built."""
    if not cpu_paged_decode.load_layer_op():
        return False
    add_step_hook(_push_step, _pop_step)
    return True


class CpuSdpaBackend:
    name = "cpu_sdpa"
    priority = 10
    # KV pruning asks for the attention mass on its evaluation steps only (the torch reference
    # and Triton give it every step): the C kernel makes it in the same pass over the keys.
    scores_every_step = False

    def is_available(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def supports(self, *, dtype, head_dim, softcap, sliding_window, block_size=None, alibi=False, sinks=False,
                 attention_chunk=-1) -> bool:
        return softcap <= 0

    def warm_up(self, *, dtype, num_kv_heads, num_heads, head_dim) -> None:
        """Build (or load from its cache) the C decode kernel now rather than in the first decode
        step: about a second the first time, milliseconds after (the C++ layer op: ~10 s once)."""
        cpu_paged_decode.load()
        _load_native_path()

    def forward(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, alibi_slopes=None,
                sinks=None, attention_chunk=-1):
        if alibi_slopes is not None or sinks is not None:
            _write(k, v, k_cache, v_cache, meta)
            return forward_masked(q, k, v, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window,
                                  attention_chunk=attention_chunk, slopes=alibi_slopes, sinks=sinks)
        masked = sliding_window > 0 or attention_chunk > 0  # the C decode kernel attends to every cached slot
        fast = _layer_op_plan(q, k, v, k_cache, v_cache, meta) if not masked else None
        if fast is not None:  # a pure-decode step: write + attend in one C++ call
            tok, tables, lens, chunk = fast
            return cpu_paged_decode.decode_layer(q, k, v, k_cache, v_cache, meta.slot_mapping, tok, tables, lens,
                                                 scale, chunk)
        _write(k, v, k_cache, v_cache, meta)
        decode_rows = [] if masked else [b for b, n in enumerate(meta.query_lens_host) if n == 1]
        if decode_rows and len(decode_rows) == meta.num_seqs:
            return _decode(q, k_cache, v_cache, meta, scale, decode_rows)
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
        if decode_rows:  # the decode rows of a mixed step: batched as in a pure decode step
            _decode(q, k_cache, v_cache, meta, scale, decode_rows, out)
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            end = start + q_len
            if q_len == 0 or (q_len == 1 and decode_rows):
                start = end
                continue
            qq = q[start:end].transpose(0, 1)
            if kv_len == q_len and (sliding_window <= 0 or sliding_window >= kv_len) and (
                    attention_chunk <= 0 or attention_chunk >= kv_len):
                o = _sdpa(qq, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1), scale=scale,
                          causal=q_len > 1)
            else:
                kk = gather_sequence(k_cache, meta.block_tables[b], kv_len).transpose(0, 1).to(q.dtype)
                vv = gather_sequence(v_cache, meta.block_tables[b], kv_len).transpose(0, 1).to(q.dtype)
                mask = visible_mask(q_len, kv_len, sliding_window, q.device, attention_chunk)
                o = _sdpa(qq, kk, vv, scale=scale, mask=mask)
            out[start:end] = o.transpose(0, 1)
            start = end
        return out

    def forward_with_scores(self, q, k, v, k_cache, v_cache, meta, *, scale, softcap, sliding_window, rows):
        """:meth:`forward` plus the attention mass of batch ``rows`` ({row: [Hkv, kv_len]}): from
        the C kernel's side output in a pure-decode step, else from the torch reference."""
        decode = sliding_window <= 0 and softcap <= 0 and meta.is_pure_decode
        if not (decode and _kernel_supported(q, k_cache, v_cache, meta)):
            from .registry import get_backend

            return get_backend("torch_reference").forward_with_scores(
                q, k, v, k_cache, v_cache, meta, scale=scale, softcap=softcap, sliding_window=sliding_window,
                rows=rows)
        _write(k, v, k_cache, v_cache, meta)
        all_rows = list(range(meta.num_seqs))
        tok, tables, lens, chunk = _kernel_plan(meta, all_rows, q.device)
        mass = torch.empty((meta.num_seqs, k_cache.shape[2], max(meta.max_seq_len, 1)), dtype=torch.float32,
                           device=q.device)
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
        cpu_paged_decode.decode_attention(q, k_cache, v_cache, tok, tables, lens, scale, out, mass, chunk=chunk)
        return out, {b: mass[b, :, :meta.seq_lens_host[b]] for b in rows}


register_backend(CpuSdpaBackend())
