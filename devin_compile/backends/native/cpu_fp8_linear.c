/* Weight-only FP8 (e4m3fn) linear for CPU at a few rows: y[m, n] = scale[n] * sum_k x[m, k] * e4m3(q[n, k]).
 *
 * Built and loaded by backends/fp8/cpu_fp8_linear.py (system C compiler, -O3 -march=native, OpenMP).
 * The torch reference (backends/fp8/kernels.py, kernel "reference") is the oracle; tests compare.
 *
 * Layout: the logical format of backends/fp8/format.py, unchanged:
 *   q      uint8 [n, k]   e4m3fn codes, row-major (NaN codes 0x7F/0xFF never occur)
 *   scale  float32 [n]
 *   x      [m, x_stride] float32, bf16 or fp16 (first k columns used)
 *   out    [m, out_stride] in x's dtype (first n columns written)
 *
 * Decoding e4m3 -> float: the portable path reads a 256-entry table. The vector paths place the
 * code's exponent and mantissa bits into a float16 (sign to bit 15, the 7 other bits shifted
 * left by 7): that float16 is exactly the e4m3 value / 256, subnormals included (both formats
 * have 3-bit mantissas, and the float16's exponent bias is 8 larger), and F16C's vcvtph2ps
 * widens 8 or 16 of them a instruction. The factor 256 is applied once per output, with the
 * row scale. Float32 arithmetic throughout: the result is "dequantize, then an fp32 matmul"
 * up to rounding order.
 *
 * Work split: threads take pairs of weight rows; each 16-column chunk of a pair is decoded once
 * and multiplied into every row of x of a tile (AVX-512: tiles of 8, 4, 2, 1 rows of x; AVX2:
 * 4, 2, 1), so at 1..16 rows the weight bytes are read once per tile and decoded once per tile.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(HAVE_AVX2) && defined(__F16C__)
#define HAVE_F16C_DECODE 1 /* the vector decoder needs F16C's vcvtph2ps */
#endif

static float LUT[256];
static int lut_ready = 0;

/* e4m3fn code -> float: sign, exponent bias 7, 3 mantissa bits, no infinities, NaN at 0x7F/0xFF. */
static float e4m3_value(int c) {
    const int e = (c >> 3) & 15, mt = c & 7;
    float v = e == 0 ? ldexpf((float)mt, -9) : ldexpf((float)(8 + mt), e - 10);
    if (e == 15 && mt == 7) v = NAN;
    return (c & 0x80) ? -v : v;
}

static void init_lut(void) {
    if (lut_ready) return;
    for (int c = 0; c < 256; c++) LUT[c] = e4m3_value(c);
    __atomic_store_n(&lut_ready, 1, __ATOMIC_RELEASE);
}

/* ---- portable: one weight row against every row of x ------------------------------------ */
static void row_scalar(const uint8_t *restrict w, int k, const float *restrict xf, int m, float *restrict res,
                       int64_t res_stride) {
    for (int r = 0; r < m; r++) {
        float sum = 0.0f;
        for (int c = 0; c < k; c++) sum += xf[(int64_t)r * k + c] * LUT[w[c]];
        res[r * res_stride] = sum;
    }
}

#ifdef HAVE_F16C_DECODE
/* 16 e4m3 codes, sign-extended to 16-bit lanes (0xFF00 | c for a negative code) -> the float16
 * bit patterns of value / 256: shifting left by 7 puts the 7 low bits at 7..13 and the sign in
 * bits 14 and 15; clearing bit 14 leaves sign | exponent | mantissa. */
static inline __m256i to_half_bits(__m128i codes) {
    const __m256i v = _mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7);
    return _mm256_and_si256(v, _mm256_set1_epi16((short)0xBFFF));
}
#endif

#if defined(HAVE_AVX512) && defined(HAVE_F16C_DECODE)
/* Two weight rows (w0, w1) x R rows of x: res[r], res[res_stride + r] get the unscaled sums / 256
 * over the first k16 columns. */
static inline __attribute__((always_inline)) void pair_avx512(const uint8_t *restrict w0,
                                                              const uint8_t *restrict w1, int k16,
                                                              const float *restrict xf, int64_t xs, const int R,
                                                              float *restrict res, int64_t res_stride) {
    __m512 a0[8], a1[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int c = 0; c < k16; c += 16) {
        const __m512 v0 = _mm512_cvtph_ps(to_half_bits(_mm_loadu_si128((const __m128i *)(w0 + c))));
        const __m512 v1 = _mm512_cvtph_ps(to_half_bits(_mm_loadu_si128((const __m128i *)(w1 + c))));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(xf + r * xs + c);
            a0[r] = _mm512_fmadd_ps(v0, xv, a0[r]);
            a1[r] = _mm512_fmadd_ps(v1, xv, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        res[r * res_stride] = _mm512_reduce_add_ps(a0[r]);
        res[r * res_stride + 1] = _mm512_reduce_add_ps(a1[r]);
    }
}
#define PAIR_TILES 8, 4, 2, 1
#define PAIR_KERNEL pair_avx512
#elif defined(HAVE_F16C_DECODE)
static inline __attribute__((always_inline)) void pair_avx2(const uint8_t *restrict w0, const uint8_t *restrict w1,
                                                            int k16, const float *restrict xf, int64_t xs,
                                                            const int R, float *restrict res, int64_t res_stride) {
    __m256 a0[8], a1[8];  /* tiles of at most 4 rows; 8 keeps the unused case 8 in bounds */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int c = 0; c < k16; c += 16) {
        const __m256i h0 = to_half_bits(_mm_loadu_si128((const __m128i *)(w0 + c)));
        const __m256i h1 = to_half_bits(_mm_loadu_si128((const __m128i *)(w1 + c)));
        const __m256 v0l = _mm256_cvtph_ps(_mm256_castsi256_si128(h0)), v0h = _mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1));
        const __m256 v1l = _mm256_cvtph_ps(_mm256_castsi256_si128(h1)), v1h = _mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256 xl = _mm256_loadu_ps(xf + r * xs + c), xh = _mm256_loadu_ps(xf + r * xs + c + 8);
            a0[r] = _mm256_fmadd_ps(v0h, xh, _mm256_fmadd_ps(v0l, xl, a0[r]));
            a1[r] = _mm256_fmadd_ps(v1h, xh, _mm256_fmadd_ps(v1l, xl, a1[r]));
        }
    }
    for (int r = 0; r < R; r++) {
        res[r * res_stride] = hsum8(a0[r]);
        res[r * res_stride + 1] = hsum8(a1[r]);
    }
}
#define PAIR_TILES 4, 2, 1
#define PAIR_KERNEL pair_avx2
#endif

#ifdef PAIR_KERNEL
/* Weight rows w0, w1 against all m rows of x, in tiles; then the scalar tail past k16, scaled. */
static void pair_rows(const uint8_t *w0, const uint8_t *w1, int k, const float *xf, int m, float *res, int64_t rs) {
    const int k16 = k & ~15;
    static const int tiles[] = {PAIR_TILES};
    int r = 0;
    for (size_t t = 0; t < sizeof(tiles) / sizeof(tiles[0]); t++) {
        const int R = tiles[t];
        for (; r + R <= m; r += R) {
            switch (R) {  /* constant R per call: the accumulators stay in registers */
                case 8: PAIR_KERNEL(w0, w1, k16, xf + (int64_t)r * k, k, 8, res + r * rs, rs); break;
                case 4: PAIR_KERNEL(w0, w1, k16, xf + (int64_t)r * k, k, 4, res + r * rs, rs); break;
                case 2: PAIR_KERNEL(w0, w1, k16, xf + (int64_t)r * k, k, 2, res + r * rs, rs); break;
                default: PAIR_KERNEL(w0, w1, k16, xf + (int64_t)r * k, k, 1, res + r * rs, rs); break;
            }
        }
    }
    for (int i = 0; i < m; i++) {
        float s0 = 0.0f, s1 = 0.0f;
        for (int c = k16; c < k; c++) {
            const float xv = xf[(int64_t)i * k + c];
            s0 += xv * (LUT[w0[c]] * (1.0f / 256.0f));  /* exact: a power of two */
            s1 += xv * (LUT[w1[c]] * (1.0f / 256.0f));
        }
        res[i * rs] += s0;
        res[i * rs + 1] += s1;
    }
}
#endif

static int fp8_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q, const float *scale,
                      int n, void *out, int64_t out_stride, int num_threads, int scalar) {
    if (m < 0 || n < 0 || k < 0) return -1;
    if (m == 0 || n == 0) return 0;
    init_lut();
#ifdef PAIR_KERNEL
    const int simd = !scalar;
#else
    const int simd = 0;
#endif
    /* xf [m, k] | res [m, n + 1] (one spare column: an odd last row is computed as a pair with itself) */
    const int64_t rs = (int64_t)n + 1;
    float *xf = malloc(((size_t)m * k + (size_t)m * rs) * sizeof(float) + 64);
    if (!xf) return -2;
    float *res = xf + (size_t)m * k;
    for (int r = 0; r < m; r++) load_row(x, r * x_stride, dtype, k, xf + (int64_t)r * k);
    const int pairs = (n + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && pairs > 1)
    for (int p = 0; p < pairs; p++) {
        const int r0 = 2 * p, r1 = r0 + 1 < n ? r0 + 1 : r0;
        const uint8_t *w0 = q + (int64_t)r0 * k, *w1 = q + (int64_t)r1 * k;
        if (simd) {
#ifdef PAIR_KERNEL
            pair_rows(w0, w1, k, xf, m, res + r0, rs);
            for (int i = 0; i < m; i++) {
                res[i * rs + r0] *= 256.0f * scale[r0];
                res[i * rs + r0 + 1] *= 256.0f * scale[r1];
            }
#endif
        } else {
            row_scalar(w0, k, xf, m, res + r0, rs);
            if (r1 != r0) row_scalar(w1, k, xf, m, res + r1, rs);
            for (int i = 0; i < m; i++) {
                res[i * rs + r0] *= scale[r0];
                if (r1 != r0) res[i * rs + r1] *= scale[r1];
            }
        }
    }
    for (int r = 0; r < m; r++) store_row(out, r * out_stride, dtype, n, res + r * rs);
    free(xf);
    return 0;
}

/* Returns 0, or a negative code for arguments it cannot take. */
int devin_fp8_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q, const float *scale,
                     int n, void *out, int64_t out_stride, int num_threads) {
    return fp8_linear(x, x_stride, m, k, dtype, q, scale, n, out, out_stride, num_threads, 0);
}

/* The same product by the portable (table) path only: tests check the vector paths against it. */
int devin_fp8_linear_scalar(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q,
                            const float *scale, int n, void *out, int64_t out_stride) {
    return fp8_linear(x, x_stride, m, k, dtype, q, scale, n, out, out_stride, 1, 1);
}

/* e4m3 codes -> floats through the vector decoder (AVX2/AVX-512 builds) or the table: tests
 * compare all 256 codes against torch's float8_e4m3fn. */
int devin_fp8_decode(const uint8_t *q, int count, float *out) {
    init_lut();
    int c = 0;
#ifdef HAVE_F16C_DECODE
    for (; c + 16 <= count; c += 16) {
        const __m256i h = to_half_bits(_mm_loadu_si128((const __m128i *)(q + c)));
        const __m256 f = _mm256_set1_ps(256.0f);
        _mm256_storeu_ps(out + c, _mm256_mul_ps(f, _mm256_cvtph_ps(_mm256_castsi256_si128(h))));
        _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(f, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))));
    }
#endif
    for (; c < count; c++) out[c] = LUT[q[c]];
    return 0;
}

/* Which vector code this build runs: 2 = AVX-512, 1 = AVX2, 0 = portable. */
int devin_fp8_simd(void) {
#if defined(HAVE_AVX512) && defined(HAVE_F16C_DECODE)
    return 2;
#elif defined(HAVE_F16C_DECODE)
    return 1;
#else
    return 0;
#endif
}
