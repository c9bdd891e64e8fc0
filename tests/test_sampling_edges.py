"""The sampler at the edges of what a request may ask: a ``top_p`` or ``temperature`` so small
that float32 rounds it to 0 (or overflows ``logits / temperature``) still gives a finite
distribution with its mass on the top logit, never the NaNs that fail an engine step
(found by fuzzing the server: ``{"top_p": 5e-324}``); the finiteness check and greedy pick
equal their elementwise definitions."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from devin_compile.runtime.sampling import SamplingParams, sample_row, sampling_probs

TINY = [5e-324, 1e-320, 1e-45, 1e-40, 1e-30, 1e-12]


@settings(max_examples=60, deadline=None)
@given(temperature=st.one_of(st.sampled_from(TINY + [0.3, 1.0, 2.0]), st.floats(1e-300, 2.0)),
       top_p=st.one_of(st.sampled_from(TINY + [0.5, 1.0]), st.floats(1e-300, 1.0)),
       top_k=st.integers(0, 40), seed=st.integers(0, 2 ** 31))
def test_probabilities_stay_finite_and_sum_to_one(temperature, top_p, top_k, seed):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed)) * 20
    params = SamplingParams(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    probs = sampling_probs(logits, params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    assert probs[int(torch.argmax(logits))] > 0  # the top token is never filtered out
    assert 0 <= sample_row(logits, params, params.make_generator()) < 50


def test_vanishing_top_p_or_temperature_samples_the_top_token():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for kw in ({"top_p": 5e-324}, {"temperature": 5e-324}, {"temperature": 1e-45, "top_p": 1e-45}):
        params = SamplingParams(do_sample=True, seed=0, **kw)
        assert sampling_probs(logits, params).tolist() == [0.0, 1.0, 0.0, 0.0]
        assert {sample_row(logits, params, params.make_generator()) for _ in range(5)} == {1}
    # ordinary settings are untouched: the nucleus of softmax(logits / 0.7) at 0.9, renormalised
    probs = torch.softmax(logits / 0.7, -1)
    order = probs.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for i in order:
        if mass >= 0.9:
            break
        keep.append(i)
        mass += float(probs[i])
    expected = torch.zeros(4)
    expected[keep] = probs[keep] / probs[keep].sum()
    got = sampling_probs(logits, SamplingParams(do_sample=True, temperature=0.7, top_p=0.9))
    assert len(keep) == 2 and torch.allclose(got, expected, atol=1e-6)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 70), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bad=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 69),
                              st.sampled_from([float("nan"), float("inf"), -float("inf")])), max_size=6),
       seed=st.integers(0, 2 ** 31))
def test_finite_rows_equals_an_elementwise_check(rows, width, dtype, bad, seed):
    """The sampler's two-reduction finiteness check flags exactly the rows holding a NaN or an infinity,
    and greedy picks the first index of each row's maximum, as argmax does (ties included)."""
    from devin_compile.runtime.sampler import finite_rows
    from devin_compile.runtime.sampling import sample_batch

    logits = (torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 5).round().to(dtype)
    for r, c, v in bad:
        if r < rows and c < width:
            logits[r, c] = v
    ok = finite_rows(logits)
    assert ok == torch.isfinite(logits).all(dim=-1).tolist()
    finite = logits[[r for r in range(rows) if ok[r]]]  # rounded: ties are common
    greedy = [SamplingParams()] * finite.shape[0]
    assert sample_batch(finite, greedy, [None] * finite.shape[0]) == torch.argmax(finite, dim=-1).tolist()
