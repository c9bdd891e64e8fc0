// A C++ CPU kernel for devin::rms_norm, so the decode step's norms skip Python and aten's
// composite rms_norm (which dispatches ~9 ops: to, pow, mean, add, rsqrt, mul, ...).
//
// Built and loaded by cpu_rms_norm_op.py (the system C++ compiler against torch's headers). Math,
// per row of x (the last dimension, D): r = 1 / sqrt(mean(x^2) + eps) in float32 (the mean
// summed in double), then y = (x * r) * w in float32, rounded once to x's dtype: aten.rms_norm's
// order of operations (the op's Python kernel), up to the rounding of the mean. It serves contiguous float32 /
// bf16 / fp16 x with a contiguous weight of the same dtype and D elements, and redispatches
// every other call to the Python kernel (CompositeExplicitAutograd).
//
// devin::add_rms_norm (a residual add and the norm after it, fuse_add_rms_norm): s = x + residual rounded
// to x's dtype (aten's add: the float32 sum, one rounding), then y = rms_norm(s) as above; returns (y, s),
// bit-identical to add then rms_norm, in one call and one pass over the row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using Signature = at::Tensor(const at::Tensor &, const at::Tensor &, double);
using AddSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                                        double);

// Element loads and stores in float; bf16 by its bits (c10's conversions do not vectorize): round to nearest
// even, NaN to 0x7FC0, exactly as c10::BFloat16(float).
template <typename T>
inline float load(const T *p, int64_t i) {
    return static_cast<float>(p[i]);
}
template <>
inline float load<c10::BFloat16>(const c10::BFloat16 *p, int64_t i) {
    const uint32_t u = static_cast<uint32_t>(p[i].x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
template <typename T>
inline void store(T *p, int64_t i, float v) {
    p[i] = static_cast<T>(v);
}
template <>
inline void store<c10::BFloat16>(c10::BFloat16 *p, int64_t i, float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    const uint16_t rounded = static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
    p[i].x = v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
}

template <typename T>
inline void rms_norm_row(const T *xr, const T *w, T *yr, int64_t d, float eps) {
    // a double sum: as close to exact as aten's float32 tree sum, in any order; eight independent lanes (one
    // chain of dependent double adds took ~1 us a row of 576), added in a fixed order: the same result at any M
    constexpr int L = 8;
    double lane[L] = {0., 0., 0., 0., 0., 0., 0., 0.};
    int64_t i = 0;
    for (; i + L <= d; i += L)
#pragma omp simd
        for (int l = 0; l < L; l++) {
            const double v = load(xr, i + l);
            lane[l] += v * v;
        }
    for (; i < d; i++) {
        const double v = load(xr, i);
        lane[i % L] += v * v;
    }
    const double sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    const float inv = 1.f / std::sqrt(static_cast<float>(sum / static_cast<double>(d)) + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; i++) {
        store(yr, i, load(xr, i) * inv * load(w, i));
    }
}

template <typename T>
void rms_norm_rows(const T *x, const T *w, T *y, int64_t rows, int64_t d, float eps) {
    // rows are independent; a row of SmolLM2 (576 values) is ~0.35 us (bf16, AVX-512): split from 17 rows
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) rms_norm_row(x + r * d, w, y + r * d, d, eps);
    });
}

template <typename T>
void add_rms_norm_rows(const T *x, const T *res, const T *w, T *y, T *s, int64_t rows, int64_t d, float eps) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) {
            const T *xr = x + r * d, *rr = res + r * d;
            T *sr = s + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) store(sr, i, load(xr, i) + load(rr, i));
            rms_norm_row(sr, w, y + r * d, d, eps);
        }
    });
}

bool serves(const at::Tensor &x, const at::Tensor &weight) {
    const auto t = x.scalar_type();
    return (t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half) &&
           x.dim() >= 1 && x.is_contiguous() && weight.scalar_type() == t && weight.dim() == 1 &&
           weight.is_contiguous() && weight.size(0) == x.size(-1) && x.size(-1) > 0;
}

at::Tensor rms_norm_cpu(const at::Tensor &x, const at::Tensor &weight, double eps) {
    const auto t = x.scalar_type();
    if (!serves(x, weight)) {
        static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("devin::rms_norm", "").typed<Signature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), x, weight, eps);
    }
    at::Tensor y = at::empty_like(x);
    const int64_t d = x.size(-1), rows = x.numel() / d;
    if (t == c10::ScalarType::Float) {
        rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, d, (float)eps);
    } else if (t == c10::ScalarType::BFloat16) {
        rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                      rows, d, (float)eps);
    } else {
        rms_norm_rows(x.data_ptr<c10::Half>(), weight.data_ptr<c10::Half>(), y.data_ptr<c10::Half>(), rows, d,
                      (float)eps);
    }
    return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor &x, const at::Tensor &residual,
                                                    const at::Tensor &weight, double eps) {
    const auto t = x.scalar_type();
    if (!serves(x, weight) || !residual.is_contiguous() || residual.scalar_type() != t ||
        residual.sizes() != x.sizes()) {
        static auto op =
            c10::Dispatcher::singleton().findSchemaOrThrow("devin::add_rms_norm", "").typed<AddSignature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), x, residual, weight,
                             eps);
    }
    at::Tensor y = at::empty_like(x), s = at::empty_like(x);
    const int64_t d = x.size(-1), rows = x.numel() / d;
    if (t == c10::ScalarType::Float) {
        add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                          y.data_ptr<float>(), s.data_ptr<float>(), rows, d, (float)eps);
    } else if (t == c10::ScalarType::BFloat16) {
        add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                          weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), s.data_ptr<c10::BFloat16>(),
                          rows, d, (float)eps);
    } else {
        add_rms_norm_rows(x.data_ptr<c10::Half>(), residual.data_ptr<c10::Half>(), weight.data_ptr<c10::Half>(),
                          y.data_ptr<c10::Half>(), s.data_ptr<c10::Half>(), rows, d, (float)eps);
    }
    return {y, s};
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) {
    m.impl("rms_norm", TORCH_FN(rms_norm_cpu));
    m.impl("add_rms_norm", TORCH_FN(add_rms_norm_cpu));
}
