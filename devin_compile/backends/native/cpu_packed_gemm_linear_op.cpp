// The CPU kernel of devin::packed_gemm_linear: y = x @ Wᵀ (+ bias) over a weight packed as
// [ceil(N/16)][K][16] (cpu_packed_gemm.c's dense layout, zero columns past N), float32, or bf16 in the
// pair layout [ceil(N/16)][K/2][16][2] (AVX512-BF16 builds: products exact, float32 sums and bias, one
// rounding to bf16), streamed once for all rows of x; a padded N is computed whole and the first N
// columns copied out. Built and
// loaded by backends/fused/cpu_packed_gemm_linear_op.py. Calls outside its preconditions (another
// dtype, another layout) are redispatched to the op's Python kernel (CompositeExplicitAutograd).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <optional>

extern "C" int devin_packed_gemm_linear(const float *x, int64_t x_stride, int64_t m, const float *w, int n, int k,
                                   float *y, int64_t y_stride, int num_threads);
extern "C" int devin_packed_gemm_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *w, int n,
                                        int k, float *y, int64_t y_stride, int num_threads);
extern "C" int devin_packed_gemm_bf16_built(void);

namespace {

using Signature = at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &, int64_t);

// bf16 x over the pair layout [nb][K/2][16][2]: float32 sums, the bias added in float32, one rounding.
bool bf16_fits(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
               int64_t out_features) {
    const auto bf16 = c10::ScalarType::BFloat16;
    return devin_packed_gemm_bf16_built() && x.scalar_type() == bf16 && x.dim() >= 1 && weight.scalar_type() == bf16 &&
           weight.dim() == 4 && weight.is_contiguous() && weight.size(2) == 16 && weight.size(3) == 2 &&
           x.size(-1) == 2 * weight.size(1) && out_features > (weight.size(0) - 1) * 16 &&
           out_features <= weight.size(0) * 16 && (!bias.has_value() || bias->scalar_type() == bf16);
}

at::Tensor packed_gemm_linear_cpu(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                             int64_t out_features) {
    const auto f32 = c10::ScalarType::Float;
    const bool half = bf16_fits(x, weight, bias, out_features);
    const bool fits = half || (x.scalar_type() == f32 && x.dim() >= 1 && weight.scalar_type() == f32 &&
                               weight.dim() == 3 && weight.is_contiguous() && weight.size(2) == 16 &&
                               x.size(-1) == weight.size(1) && weight.size(1) % 2 == 0 &&
                               out_features > (weight.size(0) - 1) * 16 && out_features <= weight.size(0) * 16 &&
                               (!bias.has_value() || bias->scalar_type() == f32));
    if (!fits) {
        static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("devin::packed_gemm_linear", "").typed<Signature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), x, weight, bias,
                             out_features);
    }
    const int64_t k = x.size(-1), n = weight.size(0) * 16;
    const at::Tensor xc = x.contiguous();
    const int64_t m = k ? xc.numel() / k : 0;
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, x.options().dtype(f32));
    if (m > 0) {
        const int rc = half ? devin_packed_gemm_linear_bf16((const uint16_t *)xc.data_ptr(), k, m,
                                                            (const uint16_t *)weight.data_ptr(), (int)n, (int)k,
                                                            out.data_ptr<float>(), n, at::get_num_threads())
                            : devin_packed_gemm_linear(xc.data_ptr<float>(), k, m, weight.data_ptr<float>(), (int)n,
                                                       (int)k, out.data_ptr<float>(), n, at::get_num_threads());
        TORCH_CHECK(rc == 0, "devin::packed_gemm_linear: the kernel rejected a weight of ", weight.sizes());
    }
    if (out_features != n) out = out.narrow(-1, 0, out_features).contiguous();
    if (bias.has_value()) out.add_(half ? bias->to(f32) : *bias);
    return half ? out.to(x.scalar_type()) : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("packed_gemm_linear", TORCH_FN(packed_gemm_linear_cpu)); }
