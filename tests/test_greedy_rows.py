"""The greedy-rows C kernel (runtime/greedy_rows.py) and the sampler's fast path that uses it: the first
index of each row's maximum and the finite check, against torch, in every build of the kernel."""
from __future__ import annotations

import pytest
import torch

from devin_compile.runtime import greedy_rows as gr
from devin_compile.runtime.sampler import NON_FINITE, sample_rows
from devin_compile.runtime.sampling import SamplingParams
from devin_compile.runtime.sequence import Sequence

needs_kernel = pytest.mark.skipif(gr._KERNEL.load() is None, reason="no C compiler here")


def _logits(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    x[0] = 1.0  # every value a maximum: the first wins
    if vocab > 20:
        x[1, vocab - 1] = 50.0  # the maximum in the scalar tail
        x[2, 3], x[2, 40 % vocab] = 9.0, 9.0  # a tie across vector lanes
        x[3, 5] = float("nan")
        x[4, vocab - 1] = float("inf")
        x[5, 0] = -float("inf")
    return x


@needs_kernel
@pytest.mark.parametrize("variant", ["native", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49157])
def test_matches_torch_in_every_build(variant: str, dtype: torch.dtype, vocab: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lib = gr._KERNEL.variant(variant).load()
    if lib is None:
        pytest.skip(f"the {variant} build is unavailable here")
    monkeypatch.setattr(gr._KERNEL, "load", lambda: lib)
    x = _logits(70, vocab, dtype)  # 70 x 49157 runs on every thread, the small ones on the caller's
    best, finite = gr.greedy_rows(x)
    assert finite == torch.isfinite(x.float()).all(-1).tolist()
    want = x.float().argmax(-1).tolist()
    assert [b for b, f in zip(best, finite) if f] == [w for w, f in zip(want, finite) if f]
    strided = torch.cat([x, x], -1)[:, :vocab]  # rows with a stride of 2V
    assert gr.greedy_rows(strided) == (best, finite)


def test_declines_what_it_does_not_take() -> None:
    assert gr.greedy_rows(torch.zeros(2, 8, dtype=torch.float16)) is None
    assert gr.greedy_rows(torch.zeros(8, 2).t()) is None  # last dim not contiguous
    assert gr.greedy_rows(torch.zeros(2, 0)) is None


@needs_kernel
def test_sampler_fast_path_equals_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """All-greedy rows take the kernel; the tokens, logprobs and per-row errors are those of the torch path."""
    x = _logits(8, 300, torch.bfloat16)
    seqs = [Sequence(str(i), [1, 2, 3], SamplingParams(max_new_tokens=4, logprobs=2 if i % 2 else None))
            for i in range(8)]
    fast = sample_rows(x, seqs)
    monkeypatch.setattr("devin_compile.runtime.sampler.greedy_rows", lambda logits: None)
    slow = sample_rows(x, seqs)
    assert fast.tokens == slow.tokens and fast.errors == slow.errors
    assert fast.errors == {3: NON_FINITE, 4: NON_FINITE, 5: NON_FINITE}
    assert fast.logprobs.keys() == slow.logprobs.keys() and all(
        fast.logprobs[r] == slow.logprobs[r] for r in fast.logprobs)
