// A C++ CPU kernel for devin::silu_mul: silu(x[..., :F]) * x[..., F:] through the same aten
// kernels as the op's Python kernel (so bit-identical), minus the Python dispatch of the split,
// getitems, silu and mul that the decode graph otherwise makes per layer. Built and loaded by
// cpu_silu_mul_op.py.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

at::Tensor silu_mul_cpu(const at::Tensor &x) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_mul: the last dimension (", x.size(-1),
                ") must be even: gate and up halves");
    const int64_t f = x.size(-1) / 2;
    at::Tensor out = at::silu(x.narrow(-1, 0, f));
    out.mul_(x.narrow(-1, f, f));
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("silu_mul", TORCH_FN(silu_mul_cpu)); }
