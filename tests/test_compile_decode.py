"""compile_decode: Inductor-compiled decode callables per bucket equal the uncompiled decode (fp32)."""
from __future__ import annotations

import pytest

import devin_compile as dc
from test_engine import greedy, hf, make_engine, model, prompt_of  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def compiled(model):  # noqa: F811
    return dc.optimize(model, num_kv_blocks=128, block_size=4, decode_buckets=(1, 2, 4), compile_decode=True,
                       max_num_seqs=8)


def test_callables_per_bucket_and_report(compiled):
    prog = compiled.program
    assert sorted(prog.decode_callables) == [1, 2, 4]
    assert compiled.engine.runner.decode_graphs.mode == "callables"
    row = next(line for line in compiled.report().splitlines() if "| compile_decode |" in line)
    assert "| ran |" in row and "buckets [1, 2, 4]" in row and "cpp_wrapper=True" in row  # the default wrapper
    assert "decode graph left dense" in compiled.report()


@pytest.mark.parametrize("batch", [1, 3, 6])  # 3 pads to bucket 4; 6 is above the largest bucket
def test_compiled_decode_greedy_equals_uncompiled_and_hf(compiled, model, hf, batch):  # noqa: F811
    calls = {"compiled": 0}
    engine = make_engine(compiled, num_blocks=96)
    real = dict(engine.runner.program.decode_callables)

    def counting(fn):
        def run(*a):
            calls["compiled"] += 1
            return fn(*a)
        return run

    engine.runner.program.decode_callables = {b: counting(f) for b, f in real.items()}
    try:
        engine.runner.pad_decode = True
        prompts = [prompt_of(3 + 5 * i, 600 + i) for i in range(batch)]
        outs = engine.generate(prompts, greedy(5))
    finally:
        engine.runner.program.decode_callables = real
    assert [o.output_ids for o in outs] == [hf(p, 5) for p in prompts]
    if batch <= 4:
        assert calls["compiled"] >= 4  # every decode step went through the compiled callable
    else:
        assert calls["compiled"] == 0  # above the largest bucket: the uncompiled decode graph


def test_compile_decode_needs_split_phases(model):  # noqa: F811
    with pytest.raises(ValueError, match="split_phases"):
        dc.optimize(model, compile_decode=True, split_phases=False)
    with pytest.raises(ValueError, match="compile_decode"):
        dc.optimize(model, compile_decode="yes")


def test_compile_decode_options_reach_inductor_and_keep_greedy_tokens(model, hf):  # noqa: F811
    """compile_decode_options={"cpp_wrapper": False} overrides the default C++ wrapper: Python calls the
    kernels (the report says so), with the same greedy tokens as HF; bad options fail before any work."""
    opt = dc.optimize(model, num_kv_blocks=64, block_size=4, decode_buckets=(1,), compile_decode=True,
                      compile_decode_options={"cpp_wrapper": False}, max_num_seqs=1)
    row = next(line for line in opt.report().splitlines() if "| compile_decode |" in line)
    assert "cpp_wrapper=False" in row and "freezing=True" in row
    p = prompt_of(7, 700)
    assert opt.generate([p], max_new_tokens=5) == [hf(p, 5)]
    with pytest.raises(ValueError, match="needs compile_decode=True"):
        dc.optimize(model, compile_decode_options={"cpp_wrapper": False})
    with pytest.raises(ValueError, match="does not know: \\['not_an_option'\\]"):
        dc.optimize(model, compile_decode=True, compile_decode_options={"not_an_option": 1})
