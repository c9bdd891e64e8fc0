// A C++ CPU kernel for devin::int4_linear's "cpu_c" calls, so they skip Python entirely.
//
// Built and loaded by cpu_int4_op.py (the system C++ compiler against torch's headers, linked
// with cpu_int4_linear.c). At batch-1 decode the op runs 120 times a step for SmolLM2, and a
// Python kernel costs ~16 us of dispatch and argument handling per call on this CPU against
// ~15-70 us of work; this kernel costs a few. It handles exactly the calls the C int4 kernel
// serves (kernel "cpu_c", a step at or below max_int4_tokens when there is a limit, no bias,
// contiguous x in float32/bf16/fp16) and redispatches every other call to the op's Python
// kernel (CompositeExplicitAutograd), which implements all of them; both give the same result.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include "cpu_torch_op.h"

extern "C" int devin_int4_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw,
                                 const float *sz, int n, int groups, int group_size, void *out, int64_t out_stride,
                                 int num_threads);

namespace {

using Signature = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, int64_t,
                             c10::string_view, const std::optional<at::Tensor> &, const std::optional<at::Tensor> &,
                             int64_t, c10::string_view);

at::Tensor int4_linear_cpu(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                           int64_t group_size, int64_t out_features, c10::string_view kernel,
                           const std::optional<at::Tensor> &bias, const std::optional<at::Tensor> &dense,
                           int64_t max_int4_tokens, c10::string_view dense_kernel) {
    const int64_t k = x.dim() ? x.size(-1) : 0;
    const int64_t rows = k ? x.numel() / k : 0;
    const int code = dtype_code(x.scalar_type());
    // a long step runs a dense GEMM (the dense copy, or dequantized tiles): the Python kernel's
    const bool long_step = max_int4_tokens >= 0 && rows > max_int4_tokens;
    if (kernel != "cpu_c" || long_step || bias.has_value() || code < 0 || k == 0 || !x.is_contiguous() ||
        scales.dim() != 4 || scales.scalar_type() != c10::ScalarType::Float || !scales.is_contiguous() ||
        qweight.scalar_type() != c10::ScalarType::Byte || !qweight.is_contiguous()) {
        static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("devin::int4_linear", "").typed<Signature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), x, qweight, scales,
                             group_size, out_features, kernel, bias, dense, max_int4_tokens, dense_kernel);
    }
    auto sizes = x.sizes().vec();
    sizes.back() = out_features;
    at::Tensor out = at::empty(sizes, x.options());
    const int rc = devin_int4_linear(x.data_ptr(), k, (int)rows, (int)k, code, qweight.data_ptr<uint8_t>(),
                                     scales.data_ptr<float>(), (int)out_features, (int)scales.size(1),
                                     (int)group_size, out.data_ptr(), out_features, at::get_num_threads());
    TORCH_CHECK(rc == 0, "the C int4 kernel rejected its arguments (code ", rc, "): x ", x.sizes(), ", qweight ",
                qweight.sizes(), ", group size ", group_size);
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("int4_linear", TORCH_FN(int4_linear_cpu)); }
// A oneDNN-packed dense copy (dense_kernel "mkldnn") is an MKLDNN tensor, which makes the
// dispatcher pick the MkldnnCPU key for the whole call: the same kernel serves it.
TORCH_LIBRARY_IMPL(devin, MkldnnCPU, m) { m.impl("int4_linear", TORCH_FN(int4_linear_cpu)); }
