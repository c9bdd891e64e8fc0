"""The stored calibration statistics (format version 2, quant/stats_format.py): fixed-point
correlations round-trip within tolerance, GPTQ on the stored Hessian solves as well as on the
fp32 one, the file size follows from the dimensions, and version-1 (all fp32) directories load."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from devin_compile.backends.int4 import format as fmt
from devin_compile.quant import awq, gptq
from devin_compile.quant import stats_format as sf
from devin_compile.quant.calibration import (GRAD_HESSIAN_BITS, HESSIAN_BITS, META_FILE, STATS_FILE,
                                             CalibrationStats, collect_stats)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(sf.BITS), count=st.integers(0, 300), seed=st.integers(0, 5))
def test_bit_packing_round_trips(bits, count, seed):
    codes = torch.randint(0, 1 << bits, (count,), generator=torch.Generator().manual_seed(seed))
    packed = sf.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == sf.packed_bytes(count, bits)
    assert torch.equal(sf.unpack_bits(packed, bits, count), codes.to(torch.int32))


@pytest.mark.parametrize("k", [0, 1, 2, 7])
@pytest.mark.parametrize("offset", [0, 1])
def test_upper_triangle_round_trips(k, offset):
    m = torch.randn(k, k, generator=torch.Generator().manual_seed(k))
    vec = sf.upper_triangle(m, offset)
    assert vec.numel() == k * (k + 1) // 2 - offset * k
    assert torch.equal(sf.from_upper_triangle(vec, k, offset), torch.triu(m, offset))
    with pytest.raises(ValueError, match="do not fill the triangle"):
        sf.from_upper_triangle(torch.zeros(vec.numel() + 1), k, offset)


def test_psd_encoding_error_bound_and_exact_diagonal():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 40, generator=gen) @ torch.randn(40, 40, generator=gen)
    x[:, 3] = 0  # a dead channel: all-zero row and column
    h = x.t() @ x / 300
    for bits in sf.BITS:
        diag, packed = sf.encode_psd(h, bits)
        back = sf.decode_psd(diag, packed, bits)
        assert torch.equal(back, back.t()) and torch.equal(torch.diagonal(back), torch.diagonal(h))
        assert not back[3].any()
        s = torch.diagonal(h).sqrt()
        bound = s[:, None] * s[None, :] / (2 * sf.levels(bits))
        assert ((back - h).abs() <= bound * 1.001 + 1e-7).all()
        # what was decoded encodes to the same codes (saving loaded statistics again loses nothing)
        assert torch.equal(sf.encode_psd(back, bits)[1], packed)


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
                      max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _chunks(n=4, length=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=gen) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    model = _tiny()
    return model, collect_stats(model, _chunks(), progress=False)


def _copy(stats: CalibrationStats) -> CalibrationStats:
    """A copy whose matrices ``save`` may replace without touching ``stats``."""
    import dataclasses
    return dataclasses.replace(stats, hessian=dict(stats.hessian), grad_hessian=dict(stats.grad_hessian))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_stored_matrices_are_close_to_fp32_and_what_was_kept_in_memory(tiny, tmp_path):
    model, exact = tiny
    stats = _copy(exact)
    stats.save(tmp_path)
    loaded = CalibrationStats.load(tmp_path, model)
    assert exact.grad_hessian and set(loaded.grad_hessian) == set(exact.hessian)
    for k in exact.hessian:
        # random weights give barely correlated inputs, the hard case for a relative error: rounding
        # noise ~ sqrt(K / 12) / L against ||C||_F ~ sqrt(K), i.e. 1.4e-3 at 12 bits and 2.2e-2 at 8
        assert _rel(loaded.hessian[k], exact.hessian[k]) < 2e-3
        assert _rel(loaded.grad_hessian[k], exact.grad_hessian[k]) < 3e-2
        assert torch.equal(torch.diagonal(loaded.hessian[k]), torch.diagonal(exact.hessian[k]))
        # save() left the object holding what load() returns
        assert torch.equal(loaded.hessian[k], stats.hessian[k])
        assert torch.equal(loaded.grad_hessian[k], stats.grad_hessian[k])
        assert torch.equal(loaded.absmean[k], exact.absmean[k])
    assert all(torch.equal(loaded.fisher[n], exact.fisher[n]) for n in exact.fisher)


def test_gptq_on_the_stored_hessian_matches_fp32(tiny, tmp_path):
    """GPTQ g32 of every linear solved with the stored Hessian, scored on the fp32 one: the summed
    relative objective tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) is within 0.5% of GPTQ's on the fp32 Hessian (GPTQ
    rounds greedily, so single linears move either way by about that much)."""
    model, exact = tiny
    _copy(exact).save(tmp_path)
    loaded = CalibrationStats.load(tmp_path, model)
    total = {"fp32": 0.0, "stored": 0.0}
    for name, lin in model.named_modules():
        if name not in exact.linear_input or "lm_head" in name:
            continue
        key = exact.linear_input[name]
        w, h = lin.weight.detach().float(), exact.hessian[key]
        for which, hs in (("fp32", h), ("stored", loaded.hessian[key])):
            q, sc, mn, _ = gptq.gptq_quantize(w, hs, 32)
            err = awq.output_error(fmt.dequantize(q, sc, mn, 32) - w, h).sum()
            total[which] += float(err / awq.output_error(w, h).sum())
    assert abs(total["stored"] / total["fp32"] - 1) < 0.005, total


def test_file_size_follows_from_the_dimensions(tiny, tmp_path):
    _model, exact = tiny
    size = _copy(exact).save(tmp_path)
    raw = (tmp_path / STATS_FILE).read_bytes()
    assert size == len(raw)
    header = struct.unpack("<Q", raw[:8])[0]
    payload = sum(sf.stored_bytes(a.numel(), HESSIAN_BITS) + 4 * a.numel() for a in exact.absmean.values())
    payload += sum(sf.stored_bytes(exact.absmean[k].numel(), GRAD_HESSIAN_BITS) for k in exact.grad_hessian)
    payload += sum(4 * f.numel() for f in exact.fisher.values())
    assert len(raw) == 8 + header + payload
    fp32 = sum(8 * a.numel() ** 2 for a in exact.absmean.values())  # hessian + grad_hessian, version 1
    assert payload < fp32 / 4


def test_version_1_directory_still_loads(tiny, tmp_path):
    model, exact = tiny
    _copy(exact).save(tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    tensors = {f"{k}.hessian": v for k, v in exact.hessian.items()}
    tensors.update({f"{k}.absmean": v for k, v in exact.absmean.items()})
    tensors.update({f"{k}.fisher": v for k, v in exact.fisher.items()})
    tensors.update({f"{k}.grad_hessian": v for k, v in exact.grad_hessian.items()})
    save_file(tensors, str(tmp_path / STATS_FILE))
    meta["version"] = 1
    del meta["correlation_bits"]
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    old = CalibrationStats.load(tmp_path, model)
    for k in exact.hessian:
        assert torch.equal(old.hessian[k], exact.hessian[k])
        assert torch.equal(old.grad_hessian[k], exact.grad_hessian[k])
    meta["version"] = 7
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a version-1 or -2"):
        CalibrationStats.load(tmp_path, model)


def test_damaged_correlations_are_refused(tiny, tmp_path):
    model, exact = tiny
    _copy(exact).save(tmp_path)
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / STATS_FILE))
    key = next(k for k in tensors if k.endswith(".hessian.corr"))
    tensors[key] = tensors[key][:-3]
    save_file(tensors, str(tmp_path / STATS_FILE))
    with pytest.raises(ValueError, match="cannot be decoded"):
        CalibrationStats.load(tmp_path, model)
