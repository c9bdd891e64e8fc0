"""llama.cpp (llama-cpp-python, the ``bench`` extra) as a batch-1 decode peer of bench/decode_peers.py.

Peers on the same SmolLM2-135M weights: ``llama.cpp Q4_1`` (our F32 export quantized by llama.cpp,
which holds the shipped GGUF's Q4_1 blocks), ``llama.cpp F16`` and ``llama.cpp BF16`` (our exports,
see bench/gguf_export.py). Each is timed like devin: greedy, EOS ignored, (new tokens - 1) / the
time after the first token, ``n_threads`` = torch's threads. A correctness check compares
llama.cpp's greedy tokens on the F32 export with HF's.

llama.cpp's extra CPU buffer types (its AMX kernels and weight repacking) are on, as llama.cpp
defaults to, unless a probe in a child process crashes with them on this machine (its AMX Q4_1 path
died with SIGSEGV on a 2-core Intel Xeon with AMX): then every peer runs with
``use_extra_bufts=False`` and the notes say so.
"""
from __future__ import annotations

import subprocess
import sys
import time

FILES = {"llama.cpp Q4_1": "q4_1", "llama.cpp F16": "f16", "llama.cpp BF16": "bf16"}


def llama_cpp_module():
    """(llama_cpp, version note), or (None, the reason it is skipped)."""
    try:
        import llama_cpp
    except ImportError:
        return None, "skipped: llama-cpp-python is not installed (pip install -e '.[bench]')"
    return llama_cpp, f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"


_EXTRA_BUFTS = {"on": True}  # llama.cpp's extra buffer types (AMX, repacking): off after a crashing probe


def load(path, threads: int):
    """A llama.cpp context on ``path`` with ``threads`` threads for decode and prefill."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    defaults = llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = _EXTRA_BUFTS["on"]
        return p
    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                               verbose=False)
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=64, verbose=False)
for _, _tok in zip(range(4), llm.generate([1, 2, 3, 4], top_k=1, temp=0.0)):
    pass
"""


def extra_bufts_note(paths: list, threads: int) -> str:
    """Decode a few tokens of each GGUF in a child process with llama.cpp's defaults; when one dies by a
    signal, turn the extra buffer types off for this run. What was done, for the notes."""
    for path in paths:
        run = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(threads)], capture_output=True, timeout=300)
        if run.returncode < 0:
            _EXTRA_BUFTS["on"] = False
            return (f"llama.cpp's extra buffer types (AMX, weight repacking) crashed on {path.name} (signal "
                    f"{-run.returncode}) on this machine: every llama.cpp peer runs with use_extra_bufts=False")
    return "llama.cpp's defaults (extra buffer types on)"


def greedy(llm, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """One cold greedy run → (its tokens, decode tokens/s after the first token)."""
    llm.reset()
    toks, t0 = [], time.perf_counter()
    for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        toks.append(tok)
        if len(toks) == 1:
            t0 = time.perf_counter()
        if len(toks) == new_tokens:
            break
    return toks, (new_tokens - 1) / max(time.perf_counter() - t0, 1e-9)


def llama_cpp_round(path, ids: list[int], new_tokens: int, threads: int):
    """(round function → tokens/s, {"tokens": its last tokens}) on ``path``, warmed up once."""
    llm, out = load(path, threads), {}

    def run() -> float:
        out["tokens"], rate = greedy(llm, ids, new_tokens)
        return rate
    run()  # warm-up
    return run, out


def tensor_bytes(path) -> int:
    """The bytes of the GGUF's tensors (what a decode step reads, besides the KV cache)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def same_blocks(a, b) -> bool:
    """Whether two GGUF files hold the same tensors, byte for byte, in the same types."""
    from gguf import GGUFReader

    ta = {t.name: t for t in GGUFReader(str(a)).tensors}
    tb = {t.name: t for t in GGUFReader(str(b)).tensors}
    return ta.keys() == tb.keys() and all(
        ta[n].tensor_type == tb[n].tensor_type and bytes(ta[n].data) == bytes(tb[n].data) for n in ta)


def prefix_match(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def llama_cpp_peers(ids: list[int], new_tokens: int, threads: int, hf_fp32_tokens: list[int], check: int = 20):
    """({peer: round fn}, {peer: tokens holder}, {peer: bytes/token}, notes) for decode_peers.py."""
    mod, note = llama_cpp_module()
    notes = {"llama.cpp": note}
    if mod is None:
        print(f"llama.cpp peers {note}", flush=True)
        return {}, {}, {}, notes
    from gguf_export import smollm2_ggufs

    from devin_compile.models import smollm2_gguf_path

    paths = smollm2_ggufs(("f32", "f16", "bf16", "q4_1"))
    ref, _ = greedy(load(paths["f32"], threads), ids, check)
    matched = prefix_match(ref, hf_fp32_tokens)
    notes["greedy_check"] = {"llama_cpp_f32_tokens": ref, "hf_fp32_tokens": hf_fp32_tokens[:check],
                             "matching_prefix": matched, "of": check}
    notes["q4_1_same_blocks_as_shipped_gguf"] = same_blocks(paths["q4_1"], smollm2_gguf_path())
    print(f"greedy check: llama.cpp F32 GGUF vs HF fp32, first {matched}/{check} tokens equal; our Q4_1 = the "
          f"shipped GGUF's blocks: {notes['q4_1_same_blocks_as_shipped_gguf']}", flush=True)
    notes["extra_buffer_types"] = extra_bufts_note([paths[kind] for kind in FILES.values()], threads)
    print(notes["extra_buffer_types"], flush=True)
    others, tokens, nbytes = {}, {}, {}
    for name, kind in FILES.items():
        others[name], tokens[name] = llama_cpp_round(paths[kind], ids, new_tokens, threads)
        nbytes[name] = tensor_bytes(paths[kind])
    return others, tokens, nbytes, notes
