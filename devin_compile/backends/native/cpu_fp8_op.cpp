// A C++ CPU kernel for devin::fp8_linear's "cpu_c" calls, so they skip Python entirely.
//
// Built and loaded by backends/fp8/cpu_fp8_op.py (the system C++ compiler against torch's headers,
// linked with cpu_fp8_linear.c), as cpu_int4_op.cpp is for devin::int4_linear. It handles exactly
// the calls the C FP8 kernel serves (kernel "cpu_c", a step at or below max_fp8_tokens when there is
// a limit, no bias, contiguous x in float32/bf16/fp16, uint8 codes in the pair layout of
// cpu_fp8_linear.c, float32 [N] scales)
// and redispatches every other call to the op's Python kernel (CompositeExplicitAutograd), which
// implements all of them; both give the same result.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include "cpu_torch_op.h"

extern "C" int devin_fp8_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q,
                                const float *scale, int n, void *out, int64_t out_stride, int num_threads);

namespace {

using Signature = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, c10::string_view,
                             const std::optional<at::Tensor> &, const std::optional<at::Tensor> &, int64_t,
                             c10::string_view);

at::Tensor fp8_linear_cpu(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scale,
                          int64_t out_features, c10::string_view kernel, const std::optional<at::Tensor> &bias,
                          const std::optional<at::Tensor> &dense, int64_t max_fp8_tokens,
                          c10::string_view dense_kernel) {
    const int64_t k = x.dim() ? x.size(-1) : 0;
    const int64_t rows = k ? x.numel() / k : 0;
    const int code = dtype_code(x.scalar_type());
    // a long step runs a dense GEMM (the dense copy, or dequantized tiles): the Python kernel's
    const bool long_step = max_fp8_tokens >= 0 && rows > max_fp8_tokens;
    if (kernel != "cpu_c" || long_step || bias.has_value() || code < 0 || k == 0 || !x.is_contiguous() ||
        qweight.dim() != 2 || qweight.size(0) != (out_features + 1) / 2 || qweight.size(1) != 2 * ((k + 63) / 64 * 64) ||
        qweight.scalar_type() != c10::ScalarType::Byte || !qweight.is_contiguous() || scale.dim() != 1 ||
        scale.size(0) != out_features || scale.scalar_type() != c10::ScalarType::Float || !scale.is_contiguous()) {
        static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("devin::fp8_linear", "").typed<Signature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), x, qweight, scale,
                             out_features, kernel, bias, dense, max_fp8_tokens, dense_kernel);
    }
    auto sizes = x.sizes().vec();
    sizes.back() = out_features;
    at::Tensor out = at::empty(sizes, x.options());
    const int rc = devin_fp8_linear(x.data_ptr(), k, (int)rows, (int)k, code, qweight.data_ptr<uint8_t>(),
                                    scale.data_ptr<float>(), (int)out_features, out.data_ptr(), out_features,
                                    at::get_num_threads());
    TORCH_CHECK(rc == 0, "the C fp8 kernel rejected its arguments (code ", rc, "): x ", x.sizes(), ", qweight ",
                qweight.sizes());
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("fp8_linear", TORCH_FN(fp8_linear_cpu)); }
// A oneDNN-packed dense copy (dense_kernel "mkldnn") is an MKLDNN tensor: the same kernel serves that key.
TORCH_LIBRARY_IMPL(devin, MkldnnCPU, m) { m.impl("fp8_linear", TORCH_FN(fp8_linear_cpu)); }
