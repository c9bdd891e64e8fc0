"""Triton dequantize-GEMM behind ``devin::int4_linear(kernel="triton")``.

Imported only when the kernel first runs (so importing devin_compile never imports triton,
and ``TRITON_INTERPRET=1`` set by then makes it run on CPU under the interpreter).
Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``; each program walks K in BLOCK_K steps, loads
the x tile, the packed bytes of its [BLOCK_K, BLOCK_N] weight tile (two columns a byte along
K, even column low, see :mod:`devin_compile.backends.int4.format`), unpacks, dequantizes with its
group's (scale, zero) (``w = (q - 8)·scale + zero``) and accumulates in fp32 with ``tl.dot``.
fp32 inputs (and every input under the interpreter, whose bf16 dot is unreliable) use IEEE
fp32 dots; bf16/fp16 inputs on GPU use half-precision dots with fp32 accumulation.
"""
import triton
import triton.language as tl


@triton.jit
def int4_mm_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, KP, stride_xm, stride_wn, stride_ym,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """y[M, N] = x[M, K] @ dequant(w)[N, KP]ᵀ. BLOCK_K divides GROUP, so one K block lies
    in one group; columns K..KP (the short last group's padding) read x as 0."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] // 2,
                    mask=n_ok[None, :], other=0)
        q = (b >> ((offs_k[:, None] % 2) * 4).to(tl.uint8)) & 15  # [BLOCK_K, BLOCK_N]
        grp = k0 // GROUP
        s = tl.load(sz_ptr + grp * N * 2 + offs_n * 2, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + grp * N * 2 + offs_n * 2 + 1, mask=n_ok, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - 8.0) * s[None, :] + z[None, :]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
