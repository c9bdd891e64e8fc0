"""Where INT4 stops paying: the measured token counts above which a dense copy beats each kernel.

A step of more tokens than :func:`max_int4_tokens` runs the dense (bf16/fp16/fp32) copy of a
linear instead of its INT4 kernel. The tables are measurements, each named with its bench file.
"""
from __future__ import annotations

import torch

from . import cpu_int4_linear, kernels

# Measured crossover (bench/quant.py --parts kernels: SmolLM2's 120 decoder linears, bf16,
# weights streamed from memory, this 2-core CPU): the int4 kernel is ~2x faster than oneDNN
# bf16 at 1-4 tokens, ~1.3x at 6-8, slower from 16 tokens on (0.4x at 64), where the bf16
# GEMM is compute-bound. Steps with more tokens than this use the dense copy.
DEFAULT_MAX_INT4_TOKENS = 8
# The same crossover on a CPU without native bf16 GEMMs (AVX2 only), where the dense copy runs
# as float32 GEMMs (ops/upcast_linear.py): int4 9.6 vs 14.6 ms at 1 token, 44.6 vs 78.4 ms at
# 16, 91 vs 89 ms at 32.
MAX_INT4_TOKENS_UPCAST = 24
# The C kernel ("cpu_c", backends/int4/cpu_int4_linear.py), keyed by (its vector build, dense path,
# activations): "onednn" = oneDNN prepacked GEMMs (fp32 everywhere; bf16/fp16 where oneDNN has
# them natively), "upcast" = float32 GEMMs over a half-precision copy; ms for the 120 linears.
# "avx2": the earlier kernel (one row per lane set) on a 2-core AMD AVX2 CPU
# (bench/results/quant-kernels-cpu_c.json): bf16 vs upcast 5.3 vs 12.4 at 1 token, 40 vs 64 at
# 16, 66 vs 72 at 24, 89 vs 81 at 32; fp32 vs oneDNN 5.1 vs 20.2 at 1, 40 vs 52 at 16, 65 vs 62
# at 24; the native-bf16 entry is aten's crossover. Not re-measured with the 16-row blocks.
# "avx512": the 16-row-block kernel on a 2-core Intel CPU with AVX-512 VNNI and AMX
# (bench/results/quant-avx512.json): bf16 vs oneDNN (AMX) 2.8 vs 11.2 at 1, 6.9 vs 10.7 at 8,
# 11.5 vs 11.3 at 12 (9.5 vs 11.0 in an earlier run: a tie); bf16 vs upcast 46.5 vs 84.6 at 64;
# fp32 vs oneDNN 3.4 vs 24.3 at 1, 46.0 vs 57.1 at 48, 64.0 vs 63.0 at 64. A portable build
# takes the "avx2" entries.
C_MAX_INT4_TOKENS = {("avx2", "onednn", "fp32"): 16, ("avx2", "upcast", "half"): 24, ("avx2", "onednn", "half"): 8,
                     ("avx512", "onednn", "fp32"): 48, ("avx512", "upcast", "half"): 64,
                     ("avx512", "onednn", "half"): 8}


def max_int4_tokens(kernel: str, dtype: torch.dtype, *, dense_native: bool) -> int:
    """Steps of more tokens than this use the dense copy: the measured crossover of CPU int4
    ``kernel`` against the dense path this CPU takes for ``dtype`` (``dense_native``: oneDNN
    has native GEMMs for it; else the dense copy runs as float32 GEMMs)."""
    if kernel == "cpu_c":
        dense = "onednn" if dense_native else "upcast"
        simd = "avx512" if cpu_int4_linear.simd() == "avx512" else "avx2"
        return C_MAX_INT4_TOKENS[(simd, dense, "fp32" if dtype == torch.float32 else "half")]
    if not kernels.cpu_kernel_fast(kernel, dtype):
        return 0  # aten's kernel has no fast fp32 path (~50x oneDNN): the dense copy serves every step
    return DEFAULT_MAX_INT4_TOKENS if dense_native else MAX_INT4_TOKENS_UPCAST
