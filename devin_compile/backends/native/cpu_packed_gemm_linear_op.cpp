// The CPU kernel of devin::packed_gemm_linear: y = x @ Wᵀ (+ bias) over a weight packed as
// [ceil(N/16)][K][16] (cpu_packed_gemm.c's dense layout, zero columns past N), streamed once for all
// rows of x; a padded N is computed whole and the first N columns copied out. Float32, or bf16 x and
// weight at up to kHalfRows rows (a tied output head at decode): the weight widened as it is read, x and
// the sums in float32 (a bf16 GEMM's products of bf16 values are exact in float32 too), the bias added
// in float32, one rounding to bf16 at the end; more bf16 rows go to the Python kernel (oneDNN's bf16
// GEMM over tiles of the weight), where widening to float32 FMAs would be ~2.5x slower. Built and
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
extern "C" int devin_packed_gemm_linear_bf16w(const float *x, int64_t x_stride, int64_t m, const uint16_t *w, int n,
                                         int k, float *y, int64_t y_stride, int num_threads);

namespace {

constexpr int64_t kHalfRows = 4;  // ops/packed_gemm_linear.py HALF_ROWS

using Signature = at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &, int64_t);

at::Tensor packed_gemm_linear_cpu(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                             int64_t out_features) {
    const auto f32 = c10::ScalarType::Float, bf16 = c10::ScalarType::BFloat16;
    const auto dt = x.scalar_type();
    const bool fits = (dt == f32 || dt == bf16) && x.dim() >= 1 && weight.scalar_type() == dt && weight.dim() == 3 &&
                      weight.is_contiguous() && weight.size(2) == 16 && x.size(-1) == weight.size(1) &&
                      weight.size(1) % 2 == 0 && out_features > (weight.size(0) - 1) * 16 &&
                      out_features <= weight.size(0) * 16 && (!bias.has_value() || bias->scalar_type() == dt) &&
                      (dt == f32 || (x.size(-1) > 0 && x.numel() / x.size(-1) <= kHalfRows));
    if (!fits) {
        static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("devin::packed_gemm_linear", "").typed<Signature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), x, weight, bias,
                             out_features);
    }
    const int64_t k = weight.size(1), n = weight.size(0) * 16;
    const at::Tensor xc = x.to(f32).contiguous();
    const int64_t m = k ? xc.numel() / k : 0;
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, xc.options());
    if (m > 0) {
        const int rc = dt == f32 ? devin_packed_gemm_linear(xc.data_ptr<float>(), k, m, weight.data_ptr<float>(), (int)n,
                                                            (int)k, out.data_ptr<float>(), n, at::get_num_threads())
                                 : devin_packed_gemm_linear_bf16w(xc.data_ptr<float>(), k, m,
                                                                  (const uint16_t *)weight.data_ptr(), (int)n, (int)k,
                                                                  out.data_ptr<float>(), n, at::get_num_threads());
        TORCH_CHECK(rc == 0, "devin::packed_gemm_linear: the kernel rejected a weight of ", weight.sizes());
    }
    if (out_features != n) out = out.narrow(-1, 0, out_features).contiguous();
    if (bias.has_value()) out.add_(bias->to(f32));
    return dt == f32 ? out : out.to(dt);
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("packed_gemm_linear", TORCH_FN(packed_gemm_linear_cpu)); }
