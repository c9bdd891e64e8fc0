"""benchmarking.time_devin_decodes: interleaved repeats, peers in the rotation."""
from __future__ import annotations

import math

import devin_compile
from devin_compile.benchmarking import time_devin_decodes


def test_peers_join_the_interleaved_rotation(tiny_model):
    model = tiny_model("llama")
    opt = devin_compile.optimize(model)
    order = []
    real_generate = opt.engine.generate

    def generate(*a, **k):
        order.append("devin")
        return real_generate(*a, **k)

    opt.engine.generate = generate
    rates = iter([10.0, 30.0, 20.0])

    def peer():
        order.append("peer")
        return next(rates)

    rows = time_devin_decodes({"devin": opt}, [5, 6, 7, 8], new_tokens=4, repeats=3, others={"peer": peer})
    assert order == ["devin"] + ["devin", "peer"] * 3  # warm-up, then A, B, A, B, ...
    assert [r.name for r in rows] == ["devin", "peer"]
    assert rows[1].decode_tok_s == 20.0 and math.isnan(rows[1].ttft_s) and rows[1].tokens == []
    assert rows[0].decode_tok_s > 0 and len(rows[0].tokens) == 4
