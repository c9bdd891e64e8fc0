"""The C decode-attention kernel under ``OMP_WAIT_POLICY=passive``: it keeps steps up to ~2^22 multiply-adds
on the calling thread there (waking sleeping threads costs more than the work), and its output is the
same, bit for bit, as with the default policy (same tasks, same merge order) and close to a float64
softmax attention."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from devin_compile.backends.attention import cpu_paged_decode

pytestmark = pytest.mark.skipif(cpu_paged_decode.load() is None, reason="no C compiler for the decode kernel")

# SmolLM2's heads at batch 1 and batch 3: 9 query heads over 3 KV heads of 64; lengths between the two thresholds
CASE = textwrap.dedent("""
    import torch
    from devin_compile.backends.attention import cpu_paged_decode

    def case():
        g = torch.Generator().manual_seed(5)
        lens, bs, hkv, group, d = [1500, 700, 40], 16, 3, 3, 64
        blocks = sum(-(-n // bs) for n in lens)
        perm = torch.randperm(blocks, generator=g).to(torch.int32)
        tables = torch.full((len(lens), -(-max(lens) // bs)), 0, dtype=torch.int32)
        at = 0
        for b, n in enumerate(lens):
            tables[b, :-(-n // bs)] = perm[at:at + -(-n // bs)]
            at += -(-n // bs)
        k = torch.randn(blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
        v = torch.randn(blocks, bs, hkv, d, generator=g).to(torch.bfloat16)
        q = (3 * torch.randn(len(lens), hkv * group, d, generator=g)).to(torch.bfloat16)  # peaked softmax
        return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)

    def run():
        q, k, v, tables, lens = case()
        out = torch.empty_like(q)
        rows = torch.arange(q.shape[0])
        return cpu_paged_decode.decode_attention(q, k, v, rows, tables, lens, 0.125, out)
""")


def _reference(q, k, v, tables, lens, scale):
    outs = []
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, :-(-n // k.shape[1])].long()
        kb = k[blocks].reshape(-1, k.shape[2], k.shape[3])[:n].double()  # [n, hkv, d]
        vb = v[blocks].reshape(-1, v.shape[2], v.shape[3])[:n].double()
        qb = q[b].double().view(k.shape[2], -1, q.shape[-1])  # [hkv, group, d]
        w = torch.softmax(torch.einsum("hgd,nhd->hgn", qb, kb) * scale, dim=-1)
        outs.append(torch.einsum("hgn,nhd->hgd", w, vb).reshape(q.shape[1], -1))
    return torch.stack(outs)


def test_passive_policy_same_output_as_default(tmp_path):
    namespace: dict = {}
    exec(CASE, namespace)
    here = namespace["run"]()
    ref = _reference(*namespace["case"](), 0.125)
    torch.testing.assert_close(here.double(), ref, rtol=1e-2, atol=2e-3)
    code = CASE + "\nimport sys\ntorch.save(run(), sys.argv[1])\n"
    out_file = tmp_path / "passive.pt"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    subprocess.run([sys.executable, "-c", code, str(out_file)], check=True, env=env, timeout=300)
    assert torch.equal(torch.load(out_file), here)
