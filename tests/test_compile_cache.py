"""The on-disk compile cache (devin_compile/compile_cache) on tiny models, each test on its own folder.

- warm equals cold on several families (sliding windows, MoE, MLA) and in bf16 (oneDNN prepacked
  weights saved dense and prepacked again): the second optimize() reads the program (a hit) and
  generates the same tokens and logits; the model's own tensors are re-bound, not stored;
- INT4 on the fly: a hit skips quantization and keeps the precision table;
- one edited weight element, another torch version: a miss;
- a flipped byte, a truncated file: rebuilt with one warning, never used;
- compile_cache=False and DEVIN_COMPILE_CACHE_OFF write nothing; a program with compiled decode
  callables is not cacheable, so with compile_decode the program before it is cached and the callables
  are compiled after the read, torch's own compile caches under the cache root; the LRU bound evicts the least recently used entry, an entry over
  the bound is not kept;
- two processes starting together on an empty cache: one compiles, the other reads its entry;
- a hit in a new process registers the C++ CPU kernels of the ops its program calls (no pass ran);
- ``devin-compile cache ls|clear``; ``--no-compile-cache``.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import devin_compile
from devin_compile.cli import build_parser, main as cli_main
from devin_compile.cli.common import check_options
from devin_compile.compile_cache import Compiled, NotCacheable, ProgramStore, key
from devin_compile.compile_cache.program_file import TENSORS_FILE, save
from devin_compile.pipeline import Program
from test_quant_data import CharTokenizer

PROMPTS = [[5, 9, 23, 7, 41], [11, 3, 17]]
ROOT = Path(__file__).resolve().parents[1]


def _optimize(model, folder, **kw):
    return devin_compile.optimize(model, compile_cache=str(folder), warmup=False, **kw)


def _statuses(caplog) -> list[str]:
    return [r.getMessage().rsplit("compile cache: ", 1)[1].rstrip(")") for r in caplog.records
            if r.getMessage().startswith("compiled ") and "compile cache: " in r.getMessage()]


def _logits(opt, ids):
    return opt.engine.forward_logits(list(ids))


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral", "deepseek_v3", "bamba", "qwen3_next"])
def test_warm_equals_cold(tiny_model, tmp_path, caplog, family):
    model = tiny_model(family)
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        cold_opt = _optimize(model, tmp_path)
        cold = cold_opt.generate(PROMPTS, max_new_tokens=10)
        cold_logits = _logits(cold_opt, PROMPTS[0])
        warm_opt = _optimize(model, tmp_path)
    assert _statuses(caplog) == ["miss", "hit"]
    assert warm_opt.generate(PROMPTS, max_new_tokens=10) == cold
    torch.testing.assert_close(_logits(warm_opt, PROMPTS[0]), cold_logits, rtol=0, atol=0)
    assert warm_opt.info.sliding_windows == cold_opt.info.sliding_windows
    assert [r.name for r in warm_opt.pass_report.records] == [r.name for r in cold_opt.pass_report.records]


def test_model_tensors_are_bound_not_stored(tiny_model, tmp_path):
    model = tiny_model("llama")
    _optimize(model, tmp_path)
    (entry,) = ProgramStore(tmp_path).entries()
    stored = torch.load(ProgramStore(tmp_path).path(entry.key) / TENSORS_FILE, weights_only=True)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and not any(t.shape == p.shape and torch.equal(t, p) for t in stored for p in norms)


def test_bf16_onednn_prepacked_round_trip(tiny_model, tmp_path, caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        cold = _optimize(model, tmp_path, dtype=torch.bfloat16).generate(PROMPTS, max_new_tokens=10)
        warm = _optimize(model, tmp_path, dtype=torch.bfloat16).generate(PROMPTS, max_new_tokens=10)
    assert _statuses(caplog) == ["miss", "hit"] and warm == cold


def test_int4_hit_skips_quantization(tiny_model, tmp_path, caplog, monkeypatch):
    model = tiny_model("llama")
    quant = {"method": "rtn", "group_size": 32, "calib_chunks": 2, "calib_len": 32, "progress": False}
    cold_opt = _optimize(model, tmp_path, quantization=quant, tokenizer=CharTokenizer())
    cold = cold_opt.generate(PROMPTS, max_new_tokens=10)
    import devin_compile.api as api

    def no_quantization(*a, **k):
        raise AssertionError("a hit must not quantize again")

    monkeypatch.setattr(api, "_resolve_quantization", no_quantization)
    warm_opt = _optimize(model, tmp_path, quantization=quant, tokenizer=CharTokenizer())
    assert warm_opt.generate(PROMPTS, max_new_tokens=10) == cold
    assert warm_opt.precision_table == cold_opt.precision_table and warm_opt.precision_table


def test_an_edited_weight_or_another_torch_is_a_miss(tiny_model, tmp_path, caplog, monkeypatch):
    model = tiny_model("qwen2", seed=3)
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        _optimize(model, tmp_path)
        with torch.no_grad():
            w = model.model.layers[1].mlp.down_proj.weight
            w[3, 5] += 0.5  # one element, not among the sampled ones a cheap digest would read
            _optimize(model, tmp_path)
            w[3, 5] -= 0.5
        monkeypatch.setattr(key, "versions", lambda: {"torch": "2.0.0"})
        _optimize(model, tmp_path)
    assert _statuses(caplog) == ["miss", "miss", "miss"]
    assert len(ProgramStore(tmp_path).entries()) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_entry_is_rebuilt_with_one_warning(tiny_model, tmp_path, caplog, damage):
    model = tiny_model("llama")
    cold = _optimize(model, tmp_path).generate(PROMPTS, max_new_tokens=8)
    store = ProgramStore(tmp_path)
    (entry,) = store.entries()
    path = store.path(entry.key) / TENSORS_FILE
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    assert store.damage(entry.key) is not None
    caplog.clear()  # (the first compile's line is captured too when another test left the logger at INFO)
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        again = _optimize(model, tmp_path).generate(PROMPTS, max_new_tokens=8)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0].getMessage()
    assert _statuses(caplog) == ["rebuilt"] and again == cold
    assert store.damage(entry.key) is None  # the rebuilt entry is whole


def test_off_writes_nothing(tiny_model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DEVIN_COMPILE_CACHE", str(tmp_path))
    monkeypatch.delenv("DEVIN_COMPILE_CACHE_OFF", raising=False)
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        devin_compile.optimize(tiny_model("llama"), compile_cache=False, warmup=False)
        monkeypatch.setenv("DEVIN_COMPILE_CACHE_OFF", "1")
        devin_compile.optimize(tiny_model("llama"), warmup=False)
    assert _statuses(caplog) == ["off", "off"]
    assert not (tmp_path / "programs").exists()
    with pytest.raises(ValueError, match="compile_cache"):
        devin_compile.optimize(tiny_model("llama"), compile_cache=3)


def test_compiled_callables_are_not_cacheable(tiny_model, tmp_path):
    opt = _optimize(tiny_model("llama"), tmp_path / "a")
    program = Program(dict(opt.program.graphs), decode_callables={1: lambda *a: None})
    with pytest.raises(NotCacheable, match="compile_decode"):
        save(tmp_path, Compiled(program, opt.info, opt.pass_report, None), tiny_model("llama"))


def test_compile_decode_program_cached_callables_compiled_after(tiny_model, tmp_path, caplog, monkeypatch):
    """compile_decode: the program before it is cached (a hit the second time) and its callables are compiled
    after the read, with torch's compile caches under the cache root; same tokens cold and warm."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = tiny_model("llama")
    kw = dict(compile_decode=True, decode_buckets=(1, 2), max_num_seqs=2)
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        cold_opt = _optimize(model, tmp_path, **kw)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "inductor").resolve())
        cold = cold_opt.generate(PROMPTS, max_new_tokens=8)
        warm_opt = _optimize(model, tmp_path, **kw)
    assert _statuses(caplog) == ["miss", "hit"]
    for opt in (cold_opt, warm_opt):
        assert sorted(opt.program.decode_callables) == [1, 2]
        assert opt.engine.runner.decode_graphs.mode == "callables"
        records = opt.pass_report.records
        assert [r.index for r in records] == list(range(1, len(records) + 1))
        assert records[-1].name == "compile_decode" and records[-1].status == "ran"
    assert warm_opt.generate(PROMPTS, max_new_tokens=8) == cold
    assert (tmp_path / "inductor").is_dir() and len(ProgramStore(tmp_path).entries()) == 1


def test_lru_bound_and_an_entry_over_the_bound(tmp_path, monkeypatch):
    store = ProgramStore(tmp_path)

    def files(size):
        return lambda folder: ((folder / "program.pkl").write_bytes(b"x" * size),
                               (folder / "key.json").write_text("{}"))

    for name in ("a", "b", "c"):
        with store.lock(name):
            assert store.write(name, files(1000))
    os.utime(store.path("a") / "checksums", (1, 1))  # a: least recently used
    assert store.read("b") is not None
    assert store.evict(2500) == ["a"]
    assert {e.key for e in store.entries()} == {"b", "c"}
    monkeypatch.setenv("DEVIN_COMPILE_CACHE_MAX_BYTES", "500")
    with store.lock("d"):
        assert not store.write("d", files(1000))
    assert not store.path("d").exists()


def test_cli_cache_ls_clear_and_flag(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEVIN_COMPILE_CACHE", str(tmp_path))
    monkeypatch.delenv("DEVIN_COMPILE_CACHE_OFF", raising=False)
    devin_compile.optimize(tiny_model("llama"), warmup=False)
    assert cli_main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "torch " in out and "1 entry" in out
    assert cli_main(["cache", "clear"]) == 0
    assert ProgramStore(tmp_path).entries() == []
    assert cli_main(["cache", "ls"]) == 0 and "0 entries" in capsys.readouterr().out
    for command in ("run", "serve"):
        args = build_parser(command).parse_args([command, "--no-compile-cache"])
        assert check_options(args)["compile_cache"] is False
    assert "compile_cache" not in check_options(build_parser("run").parse_args(["run"]))


_WORKER = textwrap.dedent("""
    import logging, sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from conftest import FAMILIES, build_model
    import devin_compile
    records = []
    class Keep(logging.Handler):
        def emit(self, r): records.append(r.getMessage())
    logging.getLogger("devin_compile").addHandler(Keep()); logging.getLogger("devin_compile").setLevel(logging.INFO)
    fam = FAMILIES["llama"]
    model = build_model(fam.model_type, fam.config_kwargs(), "eager", 0)
    opt = devin_compile.optimize(model, compile_cache={folder!r}, warmup=False)
    status = [m.rsplit("compile cache: ", 1)[1].rstrip(")") for m in records if m.startswith("compiled ")][0]
    print(status, opt.generate([[5, 9, 23]], max_new_tokens=6))
""")


def test_two_processes_on_an_empty_cache(tmp_path):
    code = _WORKER.format(root=str(ROOT), tests=str(ROOT / "tests"), folder=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    lines = [out.strip().splitlines()[-1] for out, _ in results]
    assert sorted(line.split(" ", 1)[0] for line in lines) == ["hit", "miss"]  # one waited for the other's entry
    assert lines[0].split(" ", 1)[1] == lines[1].split(" ", 1)[1]
    (entry,) = ProgramStore(tmp_path).entries()
    assert ProgramStore(tmp_path).damage(entry.key) is None


_HIT_KERNELS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    import torch
    from conftest import FAMILIES, build_model
    import devin_compile
    from devin_compile.ops.cpu_kernels import devin_ops, kernel_loaders
    fam = FAMILIES[{family!r}]
    model = build_model(fam.model_type, fam.config_kwargs(), "eager", 0)
    opt = devin_compile.optimize(model, compile_cache={folder!r}, warmup=False, dtype={dtype})
    ops = devin_ops(opt.engine.runner.program.graphs.values()) & set(kernel_loaders())
    print(sorted(op for op in ops if torch._C._dispatch_has_kernel_for_dispatch_key("devin::" + op, "CPU")))
""")


@pytest.mark.parametrize("family,dtype", [("llama", "torch.bfloat16"), ("mixtral", "torch.float32")])
def test_a_hit_in_a_new_process_registers_the_ops_cpu_kernels(tiny_model, tmp_path, family, dtype):
    """A program read from the cache ran no pass, yet a fresh process gets the C++ CPU kernels of the
    ``devin::`` ops it calls, the same ones the compiling process registered (before: the Python kernels
    served a hit, e.g. the packed bf16 output head unpacked its whole weight every step, ~4x slower)."""
    from devin_compile.ops.cpu_kernels import devin_ops, kernel_loaders

    opt = _optimize(tiny_model(family), tmp_path, dtype=eval(dtype))
    ops = devin_ops(opt.engine.runner.program.graphs.values()) & set(kernel_loaders())
    compiled_with = sorted(op for op in ops if torch._C._dispatch_has_kernel_for_dispatch_key(f"devin::{op}", "CPU"))
    assert compiled_with, f"no devin op with a C++ CPU kernel in {sorted(ops)}"
    code = _HIT_KERNELS.format(root=str(ROOT), tests=str(ROOT / "tests"), folder=str(tmp_path), family=family,
                               dtype=dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(compiled_with)
