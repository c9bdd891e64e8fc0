"""Memory of an optimized SmolLM2 measured through the process (resident memory), not by summing tensors:
each figure is a fresh process that loads the model, optimizes it, deletes the model and trims the heap,
minus a process that only loaded and deleted it (issue 41's measure; bench/memory.py reports the same)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CHILD = r"""
import ctypes, gc, json, sys
import torch
import devin_compile
from devin_compile.models import load_model

what = sys.argv[1]
torch.set_num_threads(2)
model, tok = load_model(None, torch.float32)
params = sum(p.numel() * p.element_size() for p in model.parameters())
opt = None
if what != "load":
    quant = {"quantization": {"method": "rtn", "calib_chunks": 1, "calib_len": 64}} if what == "int4" else {}
    opt = devin_compile.optimize(model, tokenizer=tok, num_kv_blocks=64, compile_cache=False, **quant)
    assert opt.generate([[1, 2, 3]], max_new_tokens=2)
del model
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(json.dumps({"rss": rss, "params": params}))
"""


def _child(what: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, what], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_resident_memory_of_dense_and_default_int4_models():
    """Dense fp32 holds each weight once (≤ 1.2x the parameter bytes over loading alone; it was 2.15x), and the
    default INT4 model (INT4 decoder linears, the INT8 head its tied embedding reads) ≤ 0.40x (it was 2.59x,
    then 0.49x with the fp32 table kept)."""
    base = _child("load")
    params = base["params"]
    dense = (_child("dense")["rss"] - base["rss"]) / params
    int4 = (_child("int4")["rss"] - base["rss"]) / params
    assert 0.8 < dense <= 1.2, dense
    assert 0.15 < int4 <= 0.40, int4
