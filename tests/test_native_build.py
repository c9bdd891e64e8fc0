"""The C/C++ kernel cache: built once per machine even by concurrent first starts, damaged entries
rebuilt, and a missing compiler as one warning line with the torch fallback still answering right.

Every test builds into its own empty cache (``DEVIN_COMPILE_CACHE`` under tmp_path), never the
shared ``~/.cache/devin_compile/kernels``. The compiler is a wrapper script around the real one
that records each compile (``-o`` in its arguments), so "the compiler ran once" is counted, not
inferred from timing.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devin_compile.backends.native import build, kernel_cache

ROOT = Path(__file__).resolve().parents[1]
REAL_CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(REAL_CC is None, reason="no C compiler on this machine")

# The small real kernel these tests build (arena_reuse.c: ~0.2 s with -O3), and a call that proves it loaded.
LOAD_AND_CALL = """
import ctypes, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from devin_compile.backends.native.build import CKernel
lib = CKernel("arena_reuse.c", {"devin_arena_reuse_stats": [ctypes.POINTER(ctypes.c_int64)]}).load()
stats = (ctypes.c_int64 * 3)()
print("ok" if lib is not None and lib.devin_arena_reuse_stats(stats) == 0 else "failed")
"""


def _counting_cc(tmp_path: Path, gate: bool = False) -> tuple[Path, Path]:
    """A compiler wrapper appending a line to ``compiles.log`` per compile; with ``gate`` it also
    touches ``started`` and holds the compile until the test creates ``release``."""
    count = tmp_path / "compiles.log"
    hold = (f'touch "{tmp_path}/started"; i=0; while [ ! -e "{tmp_path}/release" ] && [ $i -lt 1200 ]; '
            f'do sleep 0.05; i=$((i+1)); done') if gate else ":"
    script = tmp_path / "counting-cc"
    script.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo compile >> "{count}"; {hold};; esac\n'
                      f'exec "{REAL_CC}" "$@"\n')
    script.chmod(0o755)
    return script, count


def _compiles(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def _wait_for(predicate, what: str, procs=(), timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise AssertionError(f"never saw {what}")
        time.sleep(0.05)


@needs_cc
def test_concurrent_first_starts_build_once(tmp_path):
    """Two processes load the same kernel into an empty cache at the same time: the first builds
    (its compile held until the second is seen waiting on the lock), the second waits and loads
    that build. Both work; the compiler ran once."""
    cc, count = _counting_cc(tmp_path, gate=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CC": str(cc), "DEVIN_COMPILE_CACHE": str(tmp_path / "cache")}
    logs = [tmp_path / f"proc{i}.log" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_AND_CALL], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=log.open("w")) for log in logs]
    try:
        _wait_for(lambda: (tmp_path / "started").exists(), "a compile start", procs)
        _wait_for(lambda: any("waiting for another process" in log.read_text() for log in logs),
                  "the second process waiting on the lock", procs)
        (tmp_path / "release").touch()
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        (tmp_path / "release").touch()
        for p in procs:
            p.kill() if p.poll() is None else None
    texts = [log.read_text() for log in logs]
    assert [o.strip() for o in outs] == ["ok", "ok"], texts
    assert _compiles(count) == 1, texts
    assert sum("INFO built the C kernel arena_reuse.c in" in t for t in texts) == 1, texts
    assert sum("INFO waiting for another process" in t for t in texts) == 1, texts
    # and a third start finds it built: no compile, no build line
    third = subprocess.run([sys.executable, "-c", LOAD_AND_CALL], cwd=ROOT, env=env, capture_output=True, text=True)
    assert third.stdout.strip() == "ok" and "building" not in third.stderr and _compiles(count) == 1


@needs_cc
@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_damaged_entry_is_rebuilt_with_a_warning(tmp_path, monkeypatch, caplog, damage):
    cc, count = _counting_cc(tmp_path)
    monkeypatch.setenv("DEVIN_COMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    source = build.HERE / "arena_reuse.c"
    path = build.build(source, str(cc))  # built, not loaded: this process never maps the file damaged below
    assert _compiles(count) == 1 and kernel_cache.damage(path) is None
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else bytes(len(data)))
    assert kernel_cache.damage(path) is not None

    import ctypes

    with caplog.at_level(logging.INFO, logger="devin_compile"):
        lib = build.CKernel("arena_reuse.c", {"devin_arena_reuse_stats": [ctypes.POINTER(ctypes.c_int64)]}).load()
    assert lib is not None and lib.devin_arena_reuse_stats((ctypes.c_int64 * 3)()) == 0
    assert _compiles(count) == 2 and kernel_cache.damage(path) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is damaged" in warnings[0] and "rebuilding" in warnings[0], warnings
    assert build.build(source, str(cc)) == path and _compiles(count) == 2  # intact now: loaded, not rebuilt


def test_missing_compiler_names_cause_and_way_out(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-cxx"))
    with pytest.raises(build.CompilerMissing) as e:
        build.compilers(need_cxx=True)
    text = str(e.value)
    assert f"CC={tmp_path / 'no-such-cc'} is not an executable" in text and "CXX=" in text
    assert "install gcc and g++, or set CC and CXX" in text and "\n" not in text


MISSING_COMPILER_RUN = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import devin_compile
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(1))
out = devin_compile.optimize(model).generate(ids, max_new_tokens=6, do_sample=False)
ref = model.generate(ids, max_new_tokens=6, do_sample=False)[0, 9:].tolist()
print("equal" if out[0] == ref else f"differs {out} {ref}")
"""


def test_without_a_compiler_one_warning_line_and_the_torch_path(tmp_path):
    """No compiler anywhere (empty PATH, CC/CXX unset): ``optimize()`` tries every C/C++ kernel it
    uses, stderr gets one line about the compiler and no traceback, and greedy output equals HF."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env.update(PATH=str(empty), PYTHONPATH=str(ROOT), DEVIN_COMPILE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", MISSING_COMPILER_RUN], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "equal", proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "compiler" in line or "kernel" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("no C/C++ compiler found (CC is unset") and "install gcc and g++" in lines[0]
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left behind


def test_cli_shows_the_library_log(capsys):
    """``devin-compile`` sends the ``devin_compile`` logger's INFO and up to stderr (a kernel build says so there)."""
    from devin_compile.cli.logs import show_library_log

    logger = logging.getLogger("devin_compile")
    before = logger.level
    handler = show_library_log()
    try:
        assert show_library_log() is handler  # once per process
        logging.getLogger("devin_compile.backends.native.kernel_cache").info("built the C kernel x.c in 0.2 s")
        logging.getLogger("devin_compile.backends.native.build").warning("no C compiler found")
        err = capsys.readouterr().err.splitlines()
        assert "devin-compile: built the C kernel x.c in 0.2 s" in err
        assert "devin-compile: warning: no C compiler found" in err
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
