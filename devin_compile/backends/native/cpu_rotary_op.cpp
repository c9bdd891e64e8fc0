// A C++ CPU kernel for devin::rotary_heads: rotary embedding of q and k, and the head split of
// q/k/v, in one pass over the projections (instead of ~20 dispatched views, rolls, muls and adds).
//
// Built and loaded by cpu_rotary_op.py (the system C++ compiler against torch's headers, with
// -ffp-contract=off so no multiply-add is fused). Per element, with h = D/2 and j = (i + h) mod D:
//     a = round(x[i] * cos[i]),  b = round(x[j] * sin[i]),  y[i] = round(a + b)
// rounding to the inputs' dtype after each op: exactly aten's mul, roll·mul and add, so the
// result is bit-identical to the op's Python kernel (with AVX-512, float32 and bf16 heads whose half
// is a multiple of 16 take sixteen lanes at a time, same roundings). It serves float32 / bf16 / fp16 inputs of
// one dtype whose rows have a unit last stride and whose cos/sin hold T contiguous rows of D;
// every other call is redispatched to the Python kernel (CompositeExplicitAutograd).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Signature = Result(const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &,
                         const at::Tensor &, int64_t);

// x viewed as rows [T, width] with unit last stride and all leading dims of size 1: the row stride, else -1
int64_t row_stride(const at::Tensor &x, int64_t T) {
    if (x.dim() < 2 || x.size(-2) != T || x.stride(-1) != 1) return -1;
    for (int64_t d = 0; d < x.dim() - 2; d++) {
        if (x.size(d) != 1) return -1;
    }
    return x.stride(-2);
}

template <typename S>
inline S round_to(float v) {
    return static_cast<S>(v);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Sixteen lanes at a time (float32 and bf16, D/2 a multiple of 16): the same three roundings, so the
// same bits. bf16 rounds as c10::BFloat16 does (to nearest even; NaN to 0x7fc0).
inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16 *p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 round16(__m512 v, const float *) { return v; }
inline __m512 round16(__m512 v, const c10::BFloat16 *) {  // to bf16 and back, as float32 lanes
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                       _mm512_set1_epi32(1)));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}
inline void store16(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16 *p, __m512 v) {  // v holds bf16 values already (low halves zero)
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), h);
}

template <typename S>
constexpr bool kVector = std::is_same<S, float>::value || std::is_same<S, c10::BFloat16>::value;

// y[i] = round(round(x[i] * c[i]) + round(x[j] * s[i])), j = (i + h) mod d, for one head
template <typename S>
bool rotate_head16(const S *xh, const S *c, const S *s, int64_t d, S *yh) {
    if constexpr (!kVector<S>) {
        return false;
    } else {
        const int64_t h = d / 2;
        if (h % 16) return false;
        for (int64_t i = 0; i < d; i += 16) {
            const int64_t j = i < h ? i + h : i - h;
            const __m512 a = round16(_mm512_mul_ps(load16(xh + i), load16(c + i)), xh);
            const __m512 b = round16(_mm512_mul_ps(load16(xh + j), load16(s + i)), xh);
            store16(yh + i, round16(_mm512_add_ps(a, b), xh));
        }
        return true;
    }
}
#else
template <typename S>
bool rotate_head16(const S *, const S *, const S *, int64_t, S *) {
    return false;
}
#endif

template <typename S>
void rotate_rows(const S *x, int64_t xs, int64_t heads, const S *cos, const S *sin, int64_t d, S *y, int64_t t) {
    const int64_t h = d / 2;
    const S *xr = x + t * xs;
    const S *c = cos + t * d;
    const S *s = sin + t * d;
    S *yr = y + t * heads * d;
    for (int64_t head = 0; head < heads; head++) {
        const S *xh = xr + head * d;
        S *yh = yr + head * d;
        if (rotate_head16(xh, c, s, d, yh)) continue;
        for (int64_t i = 0; i < d; i++) {
            const int64_t j = i < h ? i + h : i - h;
            const S a = round_to<S>(static_cast<float>(xh[i]) * static_cast<float>(c[i]));
            const S b = round_to<S>(static_cast<float>(xh[j]) * static_cast<float>(s[i]));
            yh[i] = round_to<S>(static_cast<float>(a) + static_cast<float>(b));
        }
    }
}

template <typename S>
void run(const at::Tensor &q, int64_t qs, const at::Tensor &k, int64_t ks, const at::Tensor &v, int64_t vs,
         const at::Tensor &cos, const at::Tensor &sin, int64_t d, int64_t T, at::Tensor &qo, at::Tensor &ko,
         at::Tensor &vo) {
    const int64_t hq = q.size(-1) / d, hkv = k.size(-1) / d, wv = v.size(-1);
    const S *qp = q.data_ptr<S>(), *kp = k.data_ptr<S>(), *vp = v.data_ptr<S>();
    const S *cp = cos.data_ptr<S>(), *sp = sin.data_ptr<S>();
    S *qop = qo.data_ptr<S>(), *kop = ko.data_ptr<S>(), *vop = vo.data_ptr<S>();
    // a token is ~1 us of work at SmolLM2's sizes: split only long (prefill) steps across threads
    const int64_t grain = std::max<int64_t>(1, 16384 / ((hq + 2 * hkv) * d));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; t++) {
            rotate_rows(qp, qs, hq, cp, sp, d, qop, t);
            rotate_rows(kp, ks, hkv, cp, sp, d, kop, t);
            const S *vr = vp + t * vs;
            std::copy(vr, vr + wv, vop + t * wv);
        }
    });
}

Result rotary_heads_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &cos,
                        const at::Tensor &sin, int64_t head_dim) {
    const auto st = q.scalar_type();
    const int64_t T = q.dim() >= 2 ? q.size(-2) : -1;
    const int64_t qs = row_stride(q, T), ks = row_stride(k, T), vs = row_stride(v, T);
    const int64_t d = head_dim;
    const bool served = (st == c10::ScalarType::Float || st == c10::ScalarType::BFloat16 ||
                         st == c10::ScalarType::Half) &&
                        k.scalar_type() == st && v.scalar_type() == st && cos.scalar_type() == st &&
                        sin.scalar_type() == st && qs >= 0 && ks >= 0 && vs >= 0 && d > 0 && d % 2 == 0 &&
                        q.size(-1) % d == 0 && k.size(-1) % d == 0 && k.size(-1) > 0 &&
                        v.size(-1) % (k.size(-1) / d) == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                        cos.numel() == T * d && sin.numel() == T * d && cos.size(-1) == d && sin.size(-1) == d;
    if (!served) {
        static auto op =
            c10::Dispatcher::singleton().findSchemaOrThrow("devin::rotary_heads", "").typed<Signature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), q, k, v, cos, sin,
                             head_dim);
    }
    const int64_t hkv = k.size(-1) / d;
    auto opts = q.options();
    at::Tensor qo = at::empty({T, q.size(-1) / d, d}, opts);
    at::Tensor ko = at::empty({T, hkv, d}, opts);
    at::Tensor vo = at::empty({T, hkv, v.size(-1) / hkv}, opts);
    if (st == c10::ScalarType::Float) {
        run<float>(q, qs, k, ks, v, vs, cos, sin, d, T, qo, ko, vo);
    } else if (st == c10::ScalarType::BFloat16) {
        run<c10::BFloat16>(q, qs, k, ks, v, vs, cos, sin, d, T, qo, ko, vo);
    } else {
        run<c10::Half>(q, qs, k, ks, v, vs, cos, sin, d, T, qo, ko, vo);
    }
    return {qo, ko, vo};
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("rotary_heads", TORCH_FN(rotary_heads_cpu)); }
