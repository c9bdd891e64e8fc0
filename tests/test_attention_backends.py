"""Attention backends against the torch reference (the oracle), as hypothesis properties.

Every case is a random step over a random paged cache: 1-4 sequences mixing decode
(q_len = 1), fresh prefill and chunked prefill over cached context; kv lengths that
cross block boundaries and leave the last block partly filled; block_size 4 or 16;
GQA ratios 1-3; head_dim 16/32/64; pages assigned in random (non-contiguous) order;
in pure-decode steps, padded entries whose slot is -1. For each backend we check that

* the cache after the backend's write equals the cache after the reference write, and
  padded (-1) slots wrote nothing (every slot outside the real slot mapping is untouched);
* the output of every real token equals ``reference_paged_attention``'s.

The Triton backend runs on CPU through the Triton interpreter, so TRITON_INTERPRET=1 is
set before anything can import triton (unless the caller chose a value). It is put back
once the imports are done and re-set only while this module's tests run: left on, it
would make every other test in the session that picks a CPU backend get the (slow,
interpreted) Triton one, since "triton" outranks "cpu_sdpa" when it is available.
"""
from __future__ import annotations

import os

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ.setdefault("TRITON_INTERPRET", "1")
_INTERPRET = os.environ["TRITON_INTERPRET"] == "1"

import importlib.util  # noqa: E402
import random  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import devin_compile.backends.attention.cpu_sdpa  # noqa: E402,F401  (registers "cpu_sdpa")
import devin_compile.backends.attention.triton_paged as triton_paged  # noqa: E402  (registers "triton")
import devin_compile.ops  # noqa: E402,F401  (registers torch.ops.devin.paged_attention)
from devin_compile.backends.attention.kv_write import write_kv  # noqa: E402
from devin_compile.backends.attention.registry import get_backend  # noqa: E402
from devin_compile.backends.attention.torch_reference import reference_paged_attention  # noqa: E402
from devin_compile.step import AttentionMetadata, StepContext, step_context  # noqa: E402
from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]


@pytest.fixture(scope="module", autouse=True)
def _triton_interpreter():
    """TRITON_INTERPRET=1 for this module's tests only (read when kernels jit and in is_available)."""
    with pytest.MonkeyPatch.context() as mp:
        if _INTERPRET:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


_HAVE_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(
    not _HAVE_TRITON or not _INTERPRET,
    reason="triton backend tests need triton installed and TRITON_INTERPRET=1 (they run the kernels "
           "on CPU through the Triton interpreter)",
)

CPU = torch.device("cpu")
NULL_BLOCK = 0  # reserved page that padded entries point at; never given to a real sequence


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    num_blocks: int
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    seed: int
    softcap: float = 0.0
    sliding_window: int = -1

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata.build(self.query_lens, self.seq_lens, self.block_tables, self.slot_mapping)


def _seq_shape(draw, kind: str) -> tuple[int, int]:
    """(q_len, cached context before this step) for one sequence."""
    if kind == "decode":
        return 1, draw(st.integers(0, 40))
    if kind == "prefill":
        return draw(st.integers(1, 24)), 0
    return draw(st.integers(2, 12)), draw(st.integers(1, 30))  # chunked prefill over cached context


@st.composite
def cases(draw, *, softcap: bool = False, window: bool = False, head_dims=(16, 32, 64)) -> Case:
    block_size = draw(st.sampled_from([4, 16]))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from(list(head_dims)))
    n = draw(st.integers(1, 4))
    pure_decode = draw(st.booleans())
    kinds = ["decode"] * n if pure_decode else [draw(st.sampled_from(["decode", "prefill", "chunk"])) for _ in range(n)]
    shapes = [_seq_shape(draw, k) for k in kinds]
    num_pad = draw(st.integers(0, 2)) if pure_decode else 0

    need = [-(-(q + c) // block_size) for q, c in shapes]
    num_blocks = 1 + sum(need) + draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # random page order, skip NULL_BLOCK

    query_lens, seq_lens, tables, slots = [], [], [], []
    for (q_len, ctx), nb in zip(shapes, need):
        table = [free.pop() for _ in range(nb)]
        kv_len = ctx + q_len
        query_lens.append(q_len)
        seq_lens.append(kv_len)
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, kv_len)]
    for _ in range(num_pad):
        # CUDA-graph style padding: one query token, slot -1, reading (at most) the null page.
        pad_len = draw(st.sampled_from([0, 1]))
        query_lens.append(1)
        seq_lens.append(pad_len)
        tables.append([NULL_BLOCK] if pad_len else [])
        slots.append(-1)

    cap = draw(st.sampled_from([0.0, 0.0, 2.0, 10.0])) if softcap else 0.0
    win = draw(st.sampled_from([-1, 0, 1, 3, 8, 17])) if window else -1
    return Case(query_lens, seq_lens, tables, slots, num_blocks, block_size, hkv, group, head_dim, seed,
                softcap=cap, sliding_window=win)


def _tensors(case: Case, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(case.seed + 1)
    T, Hkv, Hq, D = case.num_tokens, case.num_kv_heads, case.num_kv_heads * case.group, case.head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v = rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D)
    # Non-zero stale cache contents, so a stray write (or a read of the wrong page) shows.
    k_cache, v_cache = rnd(case.num_blocks, case.block_size, Hkv, D), rnd(case.num_blocks, case.block_size, Hkv, D)
    return q, k, v, k_cache, v_cache


TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def check_backend(name: str, case: Case, dtype: torch.dtype = torch.float32) -> None:
    backend = get_backend(name)
    assert backend.supports(dtype=dtype, head_dim=case.head_dim, softcap=case.softcap,
                            sliding_window=case.sliding_window)
    meta = case.meta()
    q, k, v, k_cache0, v_cache0 = _tensors(case, dtype)
    scale = case.head_dim ** -0.5

    k_ref, v_ref = k_cache0.clone(), v_cache0.clone()
    write_kv(k, v, k_ref, v_ref, meta)
    expected = reference_paged_attention(q, k_ref, v_ref, meta, scale=scale, softcap=case.softcap,
                                         sliding_window=case.sliding_window)

    k_out, v_out = k_cache0.clone(), v_cache0.clone()
    out = backend.forward(q, k, v, k_out, v_out, meta, scale=scale, softcap=case.softcap,
                          sliding_window=case.sliding_window)

    # Cache: identical to the reference write, and nothing outside the real slots changed.
    assert torch.equal(k_out, k_ref), "key cache differs from the reference write"
    assert torch.equal(v_out, v_ref), "value cache differs from the reference write"
    untouched = torch.ones(case.num_blocks * case.block_size, dtype=torch.bool)
    real_slots = [s for s in case.slot_mapping if s >= 0]
    untouched[real_slots] = False
    for new, old in ((k_out, k_cache0), (v_out, v_cache0)):
        assert torch.equal(new.flatten(0, 1)[untouched], old.flatten(0, 1)[untouched]), \
            "a slot outside the slot mapping (e.g. a padded -1 entry) was written"

    # Output: every real token (padded entries' rows are garbage by contract).
    assert out.shape == expected.shape and out.dtype == q.dtype
    real = torch.tensor([s >= 0 for s in case.slot_mapping])
    torch.testing.assert_close(out[real].float(), expected[real].float(), **TOLERANCES[dtype])


# --------------------------------------------------------------------------- properties


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True))
def test_cpu_sdpa_matches_reference(case: Case) -> None:
    check_backend("cpu_sdpa", case)


@requires_triton
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_triton_matches_reference(case: Case) -> None:
    check_backend("triton", case)


@requires_triton
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(softcap=True, window=True))
def test_triton_softcap_and_sliding_window(case: Case) -> None:
    check_backend("triton", case)


@requires_triton
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(softcap=True, window=True))
def test_triton_bf16(case: Case) -> None:
    check_backend("triton", case, torch.bfloat16)


def _fixed_case(head_dim: int, *, block_size: int = 4, softcap: float = 0.0, sliding_window: int = -1) -> Case:
    """Decode, fresh prefill and chunked prefill in one step, GQA 2, scattered pages."""
    # seq 0: decode at kv 9 (blocks 7,3,5); seq 1: fresh prefill of 6 (blocks 2,8);
    # seq 2: chunk of 5 over 6 cached (blocks 1,6,4).
    tables = [[7, 3, 5], [2, 8], [1, 6, 4]]
    query_lens, seq_lens, ctx = [1, 6, 5], [9, 6, 11], [8, 0, 6]
    slots = []
    for table, kv_len, c in zip(tables, seq_lens, ctx):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, kv_len)]
    return Case(query_lens, seq_lens, tables, slots, num_blocks=9, block_size=block_size, num_kv_heads=2,
                group=2, head_dim=head_dim, seed=1234, softcap=softcap, sliding_window=sliding_window)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision_fixed(dtype: torch.dtype) -> None:
    check_backend("triton", _fixed_case(32, softcap=5.0, sliding_window=4), dtype)


@requires_triton
@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_triton_head_dims(head_dim: int) -> None:
    """Non-powers of two are padded with masks; 256 is the largest supported."""
    check_backend("triton", _fixed_case(head_dim))


@requires_triton
@pytest.mark.parametrize("sliding_window", [5, 33])
def test_triton_long_context_window(sliding_window: int) -> None:
    """Long sequences, so the window skips whole kv tiles (the loop's lower bound moves)."""
    bs = 16
    tables = [list(range(17, 8, -1)), [3, 1, 8, 5, 2, 7, 4]]  # seq 0: kv 130 decode; seq 1: chunk of 7 over 90
    query_lens, seq_lens, ctx = [1, 7], [130, 97], [129, 90]
    slots = []
    for table, kv_len, c in zip(tables, seq_lens, ctx):
        slots += [table[p // bs] * bs + p % bs for p in range(c, kv_len)]
    case = Case(query_lens, seq_lens, tables, slots, num_blocks=18, block_size=bs, num_kv_heads=1, group=3,
                head_dim=16, seed=7, sliding_window=sliding_window)
    check_backend("triton", case)
    check_backend("cpu_sdpa", case)


def _without_c_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make cpu_sdpa take its torch-only decode paths, as on a machine without a C compiler."""
    from devin_compile.backends.attention import cpu_paged_decode

    monkeypatch.setattr(cpu_paged_decode, "load", lambda: None)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(window=True))
def test_cpu_sdpa_torch_paths_match_reference(case: Case) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _without_c_kernel(mp)
        check_backend("cpu_sdpa", case)


def _decode_case(kv: list[int], *, mixed: bool, bs: int = 4, hkv: int = 2, group: int = 3, head_dim: int = 16,
                 seed: int = 11) -> Case:
    """Decode rows of the given cached lengths on scattered pages; in a ``mixed`` step rows 1
    and 4 are chunks of 6 tokens instead."""
    rng = random.Random(seed)
    free = list(range(1, 1 + sum(-(-n // bs) for n in kv) + 8))
    rng.shuffle(free)
    query_lens, seq_lens, tables, slots = [], [], [], []
    for i, n in enumerate(kv):
        q_len = 6 if (mixed and i in (1, 4)) else 1
        table = [free.pop() for _ in range(-(-n // bs))]
        query_lens.append(q_len)
        seq_lens.append(n)
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(n - q_len, n)]
    return Case(query_lens, seq_lens, tables, slots, num_blocks=len(free) + 1 + sum(len(t) for t in tables),
                block_size=bs, num_kv_heads=hkv, group=group, head_dim=head_dim, seed=seed)


@pytest.mark.parametrize("mixed", [False, True])
def test_cpu_sdpa_decode_length_groups(mixed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C kernel, decode rows of very different lengths are cut into several length
    groups (and, in a mixed step, sit between prefill rows); every row still equals the reference."""
    from devin_compile.backends.attention.cpu_sdpa import _decode_plan

    _without_c_kernel(monkeypatch)
    case = _decode_case([3, 300, 7, 290, 150, 2, 160], mixed=mixed)
    query_lens = case.query_lens
    rows = [b for b, n in enumerate(query_lens) if n == 1]
    plan = _decode_plan(case.meta(), case.block_size, torch.device("cpu"), rows)
    assert plan[0] == "groups" and len(plan[1]) >= 2
    covered = sorted(t for g in plan[1] for t in g[0].tolist())
    assert covered == sorted(sum(query_lens[:b]) for b in rows)
    check_backend("cpu_sdpa", case)


c_kernel = pytest.mark.skipif(
    __import__("devin_compile.backends.attention.cpu_paged_decode", fromlist=["load"]).load() is None,
    reason="the C decode-attention kernel cannot be built here (no C compiler)")


@c_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 2), (16, 1), (40, 4), (80, 7)])
@pytest.mark.parametrize("mixed", [False, True])
def test_c_decode_kernel_matches_reference(dtype: torch.dtype, head_dim: int, group: int, mixed: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel (the cpu_sdpa decode path here) against the reference: lengths across
    several split-K chunks (CHUNK forced to 32, so 300 keys merge 10 partial softmaxes), block
    sizes that do not divide them, head sizes for every code path (on AVX-512: 16, 64, 80 and 128 take the
    in-place 16-lane task, bf16 at 64 and 128 its pair products, 80 with a 64 + 16 feature tile and group 7
    with 4 + 3 query-head tiles; 40 the portable task with its scalar tails; with group 1 the step falls
    under the kernel's serial-work threshold and runs on the calling thread, the others on every
    thread), every dtype, pure-decode and mixed steps. Pure-decode steps take
    the C++ layer op (write + attention in one call) where it builds, and the ctypes calls when
    it is forced off."""
    from devin_compile.backends.attention import cpu_paged_decode

    monkeypatch.setattr(cpu_paged_decode, "CHUNK", 32)
    case = _decode_case([3, 300, 7, 290, 150, 2, 33], mixed=mixed, bs=16 if head_dim == 64 else 5, hkv=2,
                        group=group, head_dim=head_dim)
    paths = ["ctypes"] if mixed or not cpu_paged_decode.load_layer_op() else ["ctypes", "layer_op"]
    for path in paths:
        calls = []
        with monkeypatch.context() as m:
            if path == "ctypes":
                m.setattr(cpu_paged_decode, "load_layer_op", lambda: False)
            name = "decode_attention" if path == "ctypes" else "decode_layer"
            real = getattr(cpu_paged_decode, name)
            m.setattr(cpu_paged_decode, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
            check_backend("cpu_sdpa", case, dtype)
        assert calls, f"the C kernel did not run ({path})"


@c_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kv_write_equals_torch_write(dtype) -> None:
    """The C KV write (one call) puts rows where the torch path does: new K/V as strided views
    of a fused projection, padded entries (slot -1) written nowhere; a slot outside the pool is
    an error and writes nothing."""
    from devin_compile.backends.attention import cpu_paged_decode

    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(5, 3 * 2 * 16, generator=gen).to(dtype)
    k = fused[:, 32:64].view(5, 2, 16)  # strided: rows 96 apart
    v = fused[:, 64:].view(5, 2, 16)
    slots = torch.tensor([3, -1, 17, 0, 30], dtype=torch.int64)
    caches = [torch.randn(4, 8, 2, 16, generator=gen).to(dtype) for _ in range(2)]
    fresh = [c.clone() for c in caches]
    ref = [c.clone() for c in caches]
    keep = slots >= 0
    ref[0].view(-1, 2, 16).index_copy_(0, slots[keep], k[keep])
    ref[1].view(-1, 2, 16).index_copy_(0, slots[keep], v[keep])
    assert cpu_paged_decode.write_supported(k, v, *caches)
    cpu_paged_decode.write_kv(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_paged_decode.write_kv(k, v, caches[0], caches[1], torch.tensor([1, 2, 32, 3, 4]))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    assert not cpu_paged_decode.write_supported(k.float() if dtype != torch.float32 else k.double(), v, *caches)
    if cpu_paged_decode.load_layer_op():  # the C++ layer op writes the same way, and refuses the same slot
        q = torch.randn(5, 4, 16, generator=gen).to(dtype)
        rows, tables = torch.arange(5), torch.arange(20, dtype=torch.int32).view(5, 4) % 4
        lens = torch.tensor([4, 1, 18, 1, 31], dtype=torch.int32)
        layer = [c.clone() for c in fresh]
        cpu_paged_decode.decode_layer(q, k, v, *layer, slots, rows, tables, lens, 0.25, 32)
        assert torch.equal(layer[0], ref[0]) and torch.equal(layer[1], ref[1])
        with pytest.raises(RuntimeError, match="outside the pool"):
            cpu_paged_decode.decode_layer(q, k, v, *layer, torch.tensor([1, 2, 32, 3, 4]), rows, tables, lens, 0.25, 32)


@c_kernel
def test_c_decode_kernel_empty_rows_and_bad_arguments() -> None:
    """A row with no cached keys (a padded decode entry) comes out as zeros; a layout the
    kernel does not take is refused by ``supports`` before any call."""
    from devin_compile.backends.attention import cpu_paged_decode

    q = torch.randn(2, 4, 16)
    kc = torch.randn(3, 4, 2, 16)
    out = torch.full((2, 4, 16), float("nan"))
    cpu_paged_decode.decode_attention(q, kc, kc, torch.arange(2), torch.tensor([[1], [0]], dtype=torch.int32),
                                      torch.tensor([3, 0], dtype=torch.int32), 0.25, out)
    assert torch.equal(out[1], torch.zeros(4, 16))
    probs = torch.softmax((q[0].view(2, 2, 16) @ kc[1, :3].transpose(0, 1).transpose(1, 2)) * 0.25, -1)
    torch.testing.assert_close(out[0], (probs @ kc[1, :3].transpose(0, 1)).view(4, 16))
    assert not cpu_paged_decode.supports(q.double(), kc.double(), kc.double())
    assert not cpu_paged_decode.supports(q, kc.bfloat16(), kc.bfloat16())  # mixed dtypes
    assert not cpu_paged_decode.supports(torch.randn(2, 3, 16), kc, kc)  # 3 query heads over 2 KV heads


# --------------------------------------------------------------------------- selection


@requires_triton
def test_triton_availability_and_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("triton")
    assert backend.name == "triton" and backend.priority == 20
    assert backend.is_available(CPU)  # TRITON_INTERPRET=1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not backend.is_available(CPU)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert backend.supports(dtype=dt, head_dim=128, softcap=30.0, sliding_window=4096)
    assert backend.supports(dtype=torch.float32, head_dim=256, softcap=0.0, sliding_window=-1)
    assert backend.supports(dtype=torch.float16, head_dim=80, softcap=0.0, sliding_window=-1, block_size=4)
    assert not backend.supports(dtype=torch.float32, head_dim=512, softcap=0.0, sliding_window=-1)
    assert not backend.supports(dtype=torch.int8, head_dim=64, softcap=0.0, sliding_window=-1)


def test_triton_module_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without triton the backend just reports itself unavailable."""
    monkeypatch.setattr(triton_paged, "HAVE_TRITON", False)
    backend = triton_paged.TritonPagedBackend()
    assert not backend.is_available(CPU)
    assert not backend.supports(dtype=torch.float32, head_dim=64, softcap=0.0, sliding_window=-1)


# --------------------------------------------------------------------------- the op


class RecordingBackend:
    """Delegates to a real backend and records the calls it serves."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.priority = inner.priority
        self.calls: list[dict] = []

    def is_available(self, device):
        return self.inner.is_available(device)

    def supports(self, **kw):
        return self.inner.supports(**kw)

    def forward(self, q, k, v, k_cache, v_cache, meta, **kw):
        self.calls.append(kw)
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, **kw)


@pytest.mark.parametrize("name,softcap,served", [
    ("cpu_sdpa", 0.0, True),
    ("cpu_sdpa", 5.0, False),  # declined: falls back to the torch reference
    pytest.param("triton", 0.0, True, marks=requires_triton),
    pytest.param("triton", 5.0, True, marks=requires_triton),
])
def test_op_dispatches_to_installed_backend(name: str, softcap: float, served: bool) -> None:
    case = _fixed_case(32)
    meta = case.meta()
    spec = KVCacheSpec(num_layers=2, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                       dtype=torch.float32, block_size=case.block_size)
    cache = PagedKVCache(spec, case.num_blocks)
    q, k, v, k0, v0 = _tensors(case, torch.float32)
    layer = 1
    cache.data[layer, 0].copy_(k0)
    cache.data[layer, 1].copy_(v0)
    before = cache.data.clone()
    scale = case.head_dim ** -0.5

    k_ref, v_ref = k0.clone(), v0.clone()
    write_kv(k, v, k_ref, v_ref, meta)
    expected = reference_paged_attention(q, k_ref, v_ref, meta, scale=scale, softcap=softcap)

    backend = RecordingBackend(get_backend(name))
    with step_context(StepContext(meta, cache, backend)):
        out = torch.ops.devin.paged_attention(q, k, v, layer, scale, softcap, -1)

    assert len(backend.calls) == (1 if served else 0)
    if served:
        assert backend.calls[0] == dict(scale=scale, softcap=softcap, sliding_window=-1)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    k_layer, v_layer = cache.layer(layer)
    assert torch.equal(k_layer, k_ref) and torch.equal(v_layer, v_ref)
    assert torch.equal(cache.data[0], before[0]), "the op wrote into another layer"


@c_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_attention_mass_matches_torch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """KV pruning's scores from the C kernel (cpu_sdpa's side output, split into 32-key chunks)
    equal the torch recomputation: per KV head, the softmax mass of each cached key summed over
    its query heads (bf16: the kernel's bf16 pair products against float32 math on the same values)."""
    from devin_compile.backends.attention import cpu_paged_decode
    from devin_compile.backends.attention.attention_scores import recompute_decode_mass

    case = _decode_case([3, 300, 7, 290, 150, 2, 33], mixed=False, bs=16, hkv=3, group=3, head_dim=64)
    meta = case.meta()
    q, k, v, k_cache, v_cache = _tensors(case, dtype)
    rows = [0, 1, 3, 6]
    monkeypatch.setattr(cpu_paged_decode, "CHUNK", 32)
    _, got = get_backend("cpu_sdpa").forward_with_scores(q, k, v, k_cache, v_cache, meta, scale=0.125, softcap=0.0,
                                                          sliding_window=-1, rows=rows)
    want = recompute_decode_mass(q, k_cache, meta, rows, scale=0.125)
    assert sorted(got) == rows
    for b in rows:
        assert got[b].shape == (3, case.seq_lens[b])
        tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-4, "rtol": 2e-3}
        torch.testing.assert_close(got[b], want[b].float(), **tol)
        torch.testing.assert_close(got[b].sum(-1), torch.full((3,), 3.0), **tol)


@c_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_paged_attention_in_pure_decode_steps(dtype) -> None:
    """In a pure-decode step on cpu_sdpa, ``devin::paged_attention`` runs in C++ from the pushed
    step (no Python kernel): same cache writes and outputs as the torch reference, every layer
    counted. A nested step on another backend, a soft-capped call and a mixed step take the
    Python kernel; the outer step's state comes back after the nested one."""
    from devin_compile.backends.attention import cpu_paged_decode, cpu_sdpa
    from devin_compile.step import StepContext, step_context
    from devin_compile.runtime.kv_cache import KVCacheSpec, PagedKVCache

    import devin_compile.ops.paged_attention  # noqa: F401  (defines the op)

    if not cpu_sdpa._load_native_path():
        pytest.skip("the C++ decode ops cannot be built here")
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(2, 2, 16, dtype, 4)
    lens = [5, 1, 9]
    tables = [[0, 1], [2], [3, 4, 5]]
    slots = [tables[b][(n - 1) // 4] * 4 + (n - 1) % 4 for b, n in enumerate(lens)]
    meta = AttentionMetadata.build([1, 1, 1], lens, tables, slots)
    caches = {}
    for name in ("cpu_sdpa", "torch_reference"):
        caches[name] = PagedKVCache(spec, 6, torch.device("cpu"))
    caches["torch_reference"].data.copy_(torch.randn(caches["cpu_sdpa"].data.shape, generator=gen).to(dtype))
    caches["cpu_sdpa"].data.copy_(caches["torch_reference"].data)
    q = torch.randn(3, 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(3, 2, 16, generator=gen).to(dtype) for _ in range(2))
    op = torch.ops.devin.paged_attention.default
    outs = {}
    with torch.inference_mode():
        for name in ("torch_reference", "cpu_sdpa"):
            m = AttentionMetadata.build([1, 1, 1], lens, tables, slots)
            with step_context(StepContext(m, caches[name], get_backend(name))):
                outs[name] = [op(q, k, v, layer, 0.25) for layer in range(2)]
                if name == "cpu_sdpa":  # nested: another backend's step, then the outer state again
                    inner = AttentionMetadata.build([1, 1, 1], lens, tables, slots)
                    scratch = PagedKVCache(spec, 6, torch.device("cpu"))
                    scratch.data.copy_(caches["torch_reference"].data)
                    with step_context(StepContext(inner, scratch, get_backend("torch_reference"))):
                        nested = op(q, k, v, 1, 0.25)
                    assert inner.scratch["native_decode_layers"] == 0
                    torch.testing.assert_close(nested.float(), outs["torch_reference"][1].float(),
                                               **TOLERANCES[dtype])
                    softcapped = op(q, k, v, 1, 0.25, softcap=30.0)  # declined by cpu_sdpa: the reference
            layers = m.scratch["native_decode_layers"]
            assert layers == (2 if name == "cpu_sdpa" else 0), name
    assert torch.equal(caches["cpu_sdpa"].data, caches["torch_reference"].data)
    for got, want in zip(outs["cpu_sdpa"], outs["torch_reference"]):
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
    assert softcapped.shape == (3, 4, 16)
    # a mixed step (one sequence with two queries): the Python kernel, still the same results
    mixed = AttentionMetadata.build([2, 1], [6, 2], [[0, 1], [2]], [4, 5, 9])
    with torch.inference_mode(), step_context(StepContext(mixed, caches["cpu_sdpa"], get_backend("cpu_sdpa"))):
        op(torch.randn(3, 4, 16).to(dtype), k, v, 0, 0.25)
    assert mixed.scratch["native_decode_layers"] == 0
    assert cpu_paged_decode.load_layer_op()


@c_kernel
@pytest.mark.parametrize("variant", ["native", "avx512_no_bf16", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_kernel_builds_for_smaller_instruction_sets_agree(variant: str, dtype: torch.dtype,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build of the C kernel against float32 math on the same values: native, without AVX512-BF16
    (the in-place AVX-512 task scores by FMA instead of bf16 pair products) and without AVX-512 (the
    portable task), as a CI machine of each kind builds it; scattered blocks, lengths across chunk
    boundaries, several tasks per thread (so each claims and prefetches the next)."""
    from devin_compile.backends.attention import cpu_paged_decode as cpd

    lib = cpd._KERNEL.variant(variant).load()
    if lib is None:
        pytest.skip(f"the {variant} build is unavailable here")
    monkeypatch.setattr(cpd, "load", lambda: lib)
    g = torch.Generator().manual_seed(3)
    hkv, group, d, bs, lens = 3, 3, 64, 16, [1, 17, 300, 64, 129, 2]
    mb = max(lens) // bs + 1
    blocks = torch.randperm(len(lens) * mb + 3, generator=g)[: len(lens) * mb].view(len(lens), mb).to(torch.int32)
    k_cache, v_cache = (torch.randn(len(lens) * mb + 3, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), hkv * group, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    cpd.decode_attention(q, k_cache, v_cache, torch.arange(len(lens)), blocks, lens_t, d ** -0.5, out, chunk=32)
    for b, n in enumerate(lens):
        k = k_cache[blocks[b].long()].reshape(-1, hkv, d)[:n].float().repeat_interleave(group, 1)
        v = v_cache[blocks[b].long()].reshape(-1, hkv, d)[:n].float().repeat_interleave(group, 1)
        p = (torch.einsum("hd,khd->hk", q[b].float(), k) * d ** -0.5).softmax(-1)
        want = torch.einsum("hk,khd->hd", p, v)
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(out[b].float(), want, **tol)
