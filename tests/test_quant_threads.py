"""The quantizers' per-linear loops: one linear per worker thread, each single-threaded
(devin_compile/quant/threads.py; issue 41, part 5)."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from devin_compile import quant
from devin_compile.quant import threads
from devin_compile.quant.calibration import collect_stats


def test_map_ordered_keeps_order_runs_single_threaded_and_restores_torch_threads():
    before = torch.get_num_threads()
    seen = []

    def fn(x):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return x * x

    got = []
    assert threads.map_ordered(fn, range(9), lambda i, x, r: got.append((i, x, r)), workers=2) == [x * x for x in range(9)]
    assert got == [(i, i, i * i) for i in range(9)]  # on_result in order, in the calling thread
    assert all(n == 1 for _name, n in seen)  # no worker runs an intra-op team: workers x 1 thread in all
    assert all(name.startswith("quant") for name, _n in seen)
    assert torch.get_num_threads() == before
    assert threads.map_ordered(fn, [3], workers=4) == [9] and torch.get_num_threads() == before


def test_workers_never_exceed_the_usable_cores_and_the_env_override_is_checked(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    assert 1 <= threads.default_workers() <= min(threads.usable_cores(), torch.get_num_threads())
    monkeypatch.setenv(threads.ENV, "3")
    assert threads.default_workers() == 3
    for bad in ("two", "0"):
        monkeypatch.setenv(threads.ENV, bad)
        with pytest.raises(ValueError, match=threads.ENV):
            threads.default_workers()


def test_a_worker_error_reaches_the_caller():
    def fn(x):
        if x == 2:
            raise RuntimeError("linear 2 failed")
        return x

    with pytest.raises(RuntimeError, match="linear 2 failed"):
        threads.map_ordered(fn, range(5), workers=2)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_weights_do_not_depend_on_the_number_of_workers(monkeypatch, method):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    stats = collect_stats(model, [torch.randint(3, 256, (48,), generator=gen) for _ in range(3)], progress=False)
    results = []
    for workers in ("1", "2"):
        monkeypatch.setenv(threads.ENV, workers)
        results.append(quant.quantize(model, stats, method=method, group_size=32, progress=False))
    one, two = results
    assert one.linears.keys() == two.linears.keys()
    for name, q in one.linears.items():
        for field, value in vars(q).items():
            other = getattr(two.linears[name], field)
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (name, field)
            else:
                assert value == other, (name, field)
