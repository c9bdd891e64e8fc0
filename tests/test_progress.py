"""Progress of the long quantization loops: log lines (each tenth, elapsed, ETA) through the
``devin_compile`` logger by default, silence with ``progress=False``, callables with monotone
``(done, total)`` and a ``stage`` per loop; in the CLI rich bars on a terminal and the same log
lines when the output is a pipe. Tiny models only."""
from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from devin_compile import quant
from devin_compile.cli.progress import Bars
from devin_compile.quant import QuantConfig
from devin_compile.quant.calibration import collect_stats
from devin_compile.quant.progress import LogLines, Progress, clock
from test_cli import _tiny_llama
from test_quant_data import CharTokenizer, tiny  # noqa: F401  (tiny: a fixture)

ROOT = Path(__file__).resolve().parents[1]


class Recorder:
    """A progress callable that keeps every call, and the loops announced by ``stage``."""

    def __init__(self):
        self.loops: list[tuple[str, int, list]] = []

    def stage(self, desc: str, total: int) -> None:
        self.loops.append((desc, total, []))

    def __call__(self, done: int, total: int, *info) -> None:
        assert self.loops and self.loops[-1][1] == total, "a step before its loop's stage"
        self.loops[-1][2].append(done)


# ---------------------------------------------------------------- log lines
def test_log_lines_each_tenth_with_elapsed_and_eta(caplog):
    now = [0.0]
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        lines = LogLines(20, "work", now=lambda: now[0])
        for i in range(1, 21):
            now[0] = float(i)  # 1 s a step
            lines.update(i, f"item{i}")
    msgs = [r.getMessage() for r in caplog.records if r.name == "devin_compile.quant"]
    assert msgs[0] == "work: started, 20 steps"
    assert msgs[1] == "work: 2/20 (10%), elapsed 2.0s, ETA 18.0s [item2]"
    assert msgs[5] == "work: 10/20 (50%), elapsed 10.0s, ETA 10.0s [item10]"
    assert msgs[-1] == "work: 20/20 (100%), done in 20.0s"
    assert len(msgs) == 11  # the start, then one a tenth


def test_clock_reads_like_a_person_would_write_it():
    assert [clock(s) for s in (0.04, 12.34, 65, 706, 3725)] == ["0.0s", "12.3s", "1m05s", "11m46s", "1h02m"]


def test_library_default_logs_at_info_and_false_is_silent(tiny, caplog, capfd):
    tok = CharTokenizer()
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        stats = quant.calibrate(tiny, tok, num_chunks=3, chunk_len=32, fisher=False)  # default: log lines
        quant.quantize(tiny, stats, method="gptq", group_size=32)
    msgs = [r.getMessage() for r in caplog.records if r.name == "devin_compile.quant"]
    assert "calibrating (3 x 32 tokens): started, 3 steps" in msgs
    assert any(re.fullmatch(r"calibrating \(3 x 32 tokens\): 1/3 \(33%\), elapsed \d+\.\ds, ETA \d+\.\ds", m)
               for m in msgs)
    assert any(m.startswith("GPTQ INT4 g32: 14/14 (100%), done in ") for m in msgs)  # 7 linears x 2 layers
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "devin_compile.quant")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="devin_compile"):
        quant.calibrate(tiny, tok, num_chunks=2, chunk_len=32, fisher=False, progress=False)
        quant.quantize(tiny, stats, method="awq", group_size=32, progress=False)
        quant.quantize_for_optimize(tiny, tok, QuantConfig(method="rtn", group_size=32, calib_chunks=2,
                                                           calib_len=32, progress=False))
    assert not [r for r in caplog.records if r.name == "devin_compile.quant"]
    out = capfd.readouterr()  # and nothing on the terminal: no bars, logging not set up by the library
    assert out.err == "" and out.out == ""


# ---------------------------------------------------------------- callables
def _monotone(loop) -> None:
    desc, total, dones = loop
    assert dones and dones[-1] == total, desc
    assert all(0 <= a <= b <= total for a, b in zip(dones, dones[1:])), (desc, dones)


def test_callables_get_monotone_done_total_and_a_stage_per_loop(tiny):
    rec = Recorder()
    stats = collect_stats(tiny, [torch.randint(3, 256, (32,)) for _ in range(2)], fisher=False, progress=rec)
    quant.quantize(tiny, stats, method="awq", group_size=32, progress=rec)
    assert [(d, t) for d, t, _ in rec.loops] == [("calibrating (2 x 32 tokens)", 2), ("AWQ scale search", 8),
                                                 ("AWQ INT4 g32", 14)]
    for loop in rec.loops:
        _monotone(loop)
    assert rec.loops[0][2] == [1, 2]
    seen = []  # a plain function (no stage) gets the same calls, the item's name last
    quant.quantize(tiny, stats, method="rtn", group_size=32, progress=lambda *a: seen.append(a))
    assert [a[:2] for a in seen] == [(i, 14) for i in range(1, 15)]
    assert seen[-1] == (14, 14, "model.layers.1.mlp.down_proj")


def test_optimize_quantization_takes_a_callable(tiny):
    import devin_compile

    rec = Recorder()
    opt = devin_compile.optimize(tiny, tokenizer=CharTokenizer(), quantization={
        "method": "gptq", "group_size": 32, "calib_chunks": 2, "calib_len": 32, "progress": rec})
    assert [d for d, _t, _ in rec.loops] == ["calibrating (2 x 32 tokens)", "GPTQ INT4 g32"]
    for loop in rec.loops:
        _monotone(loop)
    assert "progress" not in opt.quant_result.config  # a runtime option: not saved with the weights


def test_bad_progress_is_a_clear_error():
    with pytest.raises(ValueError, match=r"quantization progress='yes' must be True \(log lines"):
        QuantConfig(progress="yes")
    with pytest.raises(ValueError, match="progress=3 must be True"):
        Progress(3, 10, "x")


# ---------------------------------------------------------------- the CLI
def test_cli_bars_on_a_terminal_lines_on_a_pipe(tiny):
    chunks = [torch.randint(3, 256, (32,)) for _ in range(3)]
    term = Console(file=io.StringIO(), force_terminal=True, width=100)
    with Bars(term) as bars:
        collect_stats(tiny, chunks, fisher=False, progress=bars.progress)
    drawn = term.file.getvalue()
    assert "calibrating (3 x 32 tokens)" in drawn and "3/3" in drawn and "\x1b[" in drawn  # a rich bar
    pipe = Console(file=io.StringIO(), force_terminal=False)
    with Bars(pipe) as bars:
        collect_stats(tiny, chunks, fisher=False, progress=bars.progress)
    lines = pipe.file.getvalue().splitlines()
    assert lines[0] == "calibrating (3 x 32 tokens): started, 3 steps"
    assert lines[-1].startswith("calibrating (3 x 32 tokens): 3/3 (100%), done in ")
    assert not logging.getLogger("devin_compile").handlers  # the handler goes with the block
    quiet = Console(file=io.StringIO(), force_terminal=True)
    with Bars(quiet, quiet=True) as bars:
        collect_stats(tiny, chunks, fisher=False, progress=bars.progress)
    assert quiet.file.getvalue() == ""


def test_quantize_calibrate_piped_prints_progress_lines(tmp_path):
    """The issue: `quantize calibrate` printed nothing for minutes when its output was not a terminal."""
    folder = _tiny_llama(tmp_path / "small")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "devin_compile.cli", "quantize", "calibrate", "--model", str(folder),
                          "--chunks", "10", "--chunk-len", "32", "--out", str(tmp_path / "calib")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"loading {folder} ..."  # a stage line where a terminal gets a spinner
    steps = [re.fullmatch(r"calibrating \(10 x 32 tokens\): (\d+)/10 \((\d+)%\), elapsed (\d+\.\d)s, ETA \d+\.\ds", ln)
             for ln in lines]
    steps = [m for m in steps if m]
    assert [int(m[1]) for m in steps] == list(range(1, 10)) and [int(m[2]) for m in steps] == list(range(10, 100, 10))
    assert [float(m[3]) for m in steps] == sorted(float(m[3]) for m in steps)
    assert any(re.fullmatch(r"calibrating \(10 x 32 tokens\): 10/10 \(100%\), done in \d+\.\ds", ln) for ln in lines)
    assert "calibration statistics of 15 linears" in out.stdout  # 7 x 2 and the output head
