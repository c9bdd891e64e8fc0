"""Triton attention-mass side output (KV pruning) against the torch reference, under TRITON_INTERPRET=1.

Random paged steps (decode rows and prefill chunks over cached context, scattered pages, GQA,
soft-capping): ``TritonPagedBackend.forward_with_scores`` must give the reference's output and
its per-slot attention mass ([Hkv, seq_len] per row, summed over the step's queries and each KV
head's query group). The interpreter setting is scoped like in test_attention_backends.py.
"""
from __future__ import annotations

import os

_PREV = os.environ.get("TRITON_INTERPRET")
os.environ.setdefault("TRITON_INTERPRET", "1")
_INTERPRET = os.environ["TRITON_INTERPRET"] == "1"

import importlib.util  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import devin_compile.backends.attention.triton_paged as triton_paged  # noqa: E402,F401
from devin_compile.backends.attention.registry import get_backend  # noqa: E402
from devin_compile.step import AttentionMetadata  # noqa: E402

if _PREV is None:
    del os.environ["TRITON_INTERPRET"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or not _INTERPRET,
                                reason="needs triton and TRITON_INTERPRET=1 (kernels run in the interpreter on CPU)")


@pytest.fixture(autouse=True)
def _interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def make_step(seed: int, softcap: float):
    rng = random.Random(seed)
    bs, Hkv, G, D = rng.choice([4, 16]), rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([16, 32])
    nblocks = 48
    pages = list(range(nblocks))
    rng.shuffle(pages)
    qlens, slens, tables, slots = [], [], [], []
    for _ in range(rng.randint(1, 3)):
        q_len = 1 if rng.random() < 0.6 else rng.randint(2, 9)
        kv = rng.randint(q_len, 40)
        nb = (kv + bs - 1) // bs
        table = [pages.pop() for _ in range(nb)]
        qlens.append(q_len)
        slens.append(kv)
        tables.append(table)
        slots.extend(table[p // bs] * bs + p % bs for p in range(kv - q_len, kv))
    T = sum(qlens)
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn((nblocks, bs, Hkv, D), generator=g)
    vc = torch.randn((nblocks, bs, Hkv, D), generator=g)
    q = torch.randn((T, Hkv * G, D), generator=g)
    k = torch.randn((T, Hkv, D), generator=g)
    v = torch.randn((T, Hkv, D), generator=g)
    meta = AttentionMetadata.build(qlens, slens, tables, slots)
    return q, k, v, kc, vc, meta, dict(scale=D ** -0.5, softcap=softcap, sliding_window=-1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_triton_mass_matches_reference(seed, softcap):
    q, k, v, kc, vc, meta, kw = make_step(seed, softcap)
    rows = list(range(meta.num_seqs))
    kc2, vc2 = kc.clone(), vc.clone()
    ref_out, ref_mass = get_backend("torch_reference").forward_with_scores(q, k, v, kc, vc, meta, rows=rows, **kw)
    out, mass = get_backend("triton").forward_with_scores(q, k, v, kc2, vc2, meta, rows=rows, **kw)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    assert sorted(mass) == rows
    for b in rows:
        assert mass[b].shape == ref_mass[b].shape == (kc.shape[2], meta.seq_lens_host[b])
        torch.testing.assert_close(mass[b], ref_mass[b], atol=1e-5, rtol=1e-4)
        # each KV head's row sums to G query heads x q_len queries
        G = q.shape[1] // kc.shape[2]
        torch.testing.assert_close(mass[b].sum(-1), torch.full((kc.shape[2],), float(G * meta.query_lens_host[b])))
