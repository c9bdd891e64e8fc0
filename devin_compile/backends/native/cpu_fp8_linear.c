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
 * code's exponent and mantissa bits into a float16 (sign-extend the byte to 16 bits, shift left
 * by 7, clear bit 14): that float16 is exactly the e4m3 value / 256, subnormals included (both
 * formats have 3-bit mantissas, and the float16's exponent bias is 8 larger), and F16C's
 * vcvtph2ps widens 8 or 16 of them a instruction; float32 FMAs follow. The factor 256 is applied
 * once per output, with the row scale. bf16 activations on CPUs with AVX512-BF16 and VBMI take a
 * third path (pair_bf16 below): vpermi2b table lookups decode 64 codes to bf16 at once (every e4m3
 * value is a bf16 value) and vdpbf16ps multiplies pairs. Float32 sums throughout: the result is
 * "dequantize, then an fp32 matmul" up to rounding order.
 *
 * Work split: threads take pairs of weight rows; each decoded chunk of a pair is multiplied into
 * every row of x of a tile (AVX-512: tiles of 8, 4, 2, 1 rows of x; AVX2: 4, 2, 1), so at 1..16
 * rows the weight bytes are read and decoded once per tile.
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

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static void init_bf16_tables(void);
#endif

static void init_lut(void) {
    if (lut_ready) return;
    for (int c = 0; c < 256; c++) LUT[c] = e4m3_value(c);
#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    init_bf16_tables();
#endif
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
/* Weight rows stream from memory at decode and each 64 bytes of them take a while to decode, so
 * the hardware prefetcher alone leaves the loads exposed: fetch the same columns PF_PAIRS row
 * pairs ahead (past the last row the hint is dropped, never faulting). */
#define PF_PAIRS 4
/* k: the row length in bytes (the pair kernels' x stride) */
static inline void prefetch_ahead(const uint8_t *w0, const uint8_t *w1, int64_t k) {
    _mm_prefetch((const char *)(w0 + 2 * PF_PAIRS * k), _MM_HINT_T0);
    _mm_prefetch((const char *)(w1 + 2 * PF_PAIRS * k), _MM_HINT_T0);
}

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
        if ((c & 63) == 0) prefetch_ahead(w0 + c, w1 + c, xs);
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

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define HAVE_VBMI_DECODE 1
/* On CPUs with AVX512-VBMI: every e4m3 value is a bf16 value, so two 128-entry byte tables (the
 * bf16's high and low bytes of each magnitude) looked up with vpermi2b decode 64 codes into 64
 * bf16 in five instructions (two lookups, the sign OR-ed into the high bytes, two byte
 * interleaves). bf16 activations with AVX512-BF16 multiply those with vdpbf16ps (32 pairs a
 * instruction, products exact, sums in float32); others widen them to float32 by two more word
 * interleaves with zeros and use FMAs. The interleaves permute the columns of each 64-column
 * block (bf16: elements {0-7, 16-23, 32-39, 48-55} then {8-15, ...}; float32: four vectors of
 * 16 in the order of vbmi_column): x is laid out in that order once per call. */
static uint8_t BF16_HI[128], BF16_LO[128];

static void init_bf16_tables(void) {
    for (int c = 0; c < 128; c++) {
        uint32_t u;
        memcpy(&u, &LUT[c], 4);
        BF16_HI[c] = (uint8_t)(u >> 24);
        BF16_LO[c] = (uint8_t)(u >> 16);
    }
}

/* Column (within its 64-column block) of element i of the decoded block: bf16 or float32 order. */
static inline int vbmi_column(int i, int bf16) {
    if (bf16) return i < 32 ? (i / 8) * 16 + i % 8 : ((i - 32) / 8) * 16 + 8 + (i - 32) % 8;
    return 16 * ((i % 16) / 4) + 4 * (i / 16) + i % 4;
}

typedef struct {
    __m512i th0, th1, tl0, tl1, sign;
} vbmi_tables;

static inline vbmi_tables load_tables(void) {
    vbmi_tables t = {_mm512_loadu_si512(BF16_HI), _mm512_loadu_si512(BF16_HI + 64), _mm512_loadu_si512(BF16_LO),
                     _mm512_loadu_si512(BF16_LO + 64), _mm512_set1_epi8((char)0x80)};
    return t;
}

/* 64 codes -> bf16 words, in two vectors (see the order above). */
static inline __attribute__((always_inline)) void decode64(const uint8_t *w, const vbmi_tables *t, __m512i *b0,
                                                           __m512i *b1) {
    const __m512i codes = _mm512_loadu_si512(w);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->th0, codes, t->th1), codes, t->sign, 0xF8);
    const __m512i lo = _mm512_permutex2var_epi8(t->tl0, codes, t->tl1);
    *b0 = _mm512_unpacklo_epi8(lo, hi);
    *b1 = _mm512_unpackhi_epi8(lo, hi);
}

/* Float32 activations (permuted, xs apart): two weight rows x R rows of x over k64 columns. */
static inline __attribute__((always_inline)) void pair_vbmi_f32(const uint8_t *restrict w0, const uint8_t *restrict w1,
                                                                int k64, const float *restrict xp, int64_t xs,
                                                                const int R, float *restrict res, int64_t res_stride) {
    const vbmi_tables t = load_tables();
    const __m512i zero = _mm512_setzero_si512();
    __m512 a0[8], a1[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int c = 0; c < k64; c += 64) {
        prefetch_ahead(w0 + c, w1 + c, xs);
        __m512 v[2][4];
        for (int j = 0; j < 2; j++) {
            __m512i b0, b1;
            decode64((j ? w1 : w0) + c, &t, &b0, &b1);
            v[j][0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, b0));
            v[j][1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, b0));
            v[j][2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, b1));
            v[j][3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, b1));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                const __m512 xv = _mm512_loadu_ps(xp + r * xs + c + 16 * q);
                a0[r] = _mm512_fmadd_ps(v[0][q], xv, a0[r]);
                a1[r] = _mm512_fmadd_ps(v[1][q], xv, a1[r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        res[r * res_stride] = _mm512_reduce_add_ps(a0[r]) * (1.0f / 256.0f);  /* as the other paths: value / 256 */
        res[r * res_stride + 1] = _mm512_reduce_add_ps(a1[r]) * (1.0f / 256.0f);
    }
}

#ifdef __AVX512BF16__
#define HAVE_BF16_DOT 1
static inline __attribute__((always_inline)) void pair_bf16(const uint8_t *restrict w0, const uint8_t *restrict w1,
                                                            int k64, const uint16_t *restrict xb, int64_t xs,
                                                            const int R, float *restrict res, int64_t res_stride) {
    const vbmi_tables t = load_tables();
    __m512 a0[8], a1[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int c = 0; c < k64; c += 64) {
        prefetch_ahead(w0 + c, w1 + c, xs);
        __m512i v[2][2];
        for (int j = 0; j < 2; j++) decode64((j ? w1 : w0) + c, &t, &v[j][0], &v[j][1]);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xb + r * xs + c);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xb + r * xs + c + 32);
            a0[r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a0[r], (__m512bh)v[0][0], x0), (__m512bh)v[0][1], x1);
            a1[r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a1[r], (__m512bh)v[1][0], x0), (__m512bh)v[1][1], x1);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        res[r * res_stride] = _mm512_reduce_add_ps(a0[r]) * (1.0f / 256.0f);
        res[r * res_stride + 1] = _mm512_reduce_add_ps(a1[r]) * (1.0f / 256.0f);
    }
}
#endif
#endif
#elif defined(HAVE_F16C_DECODE)
static inline __attribute__((always_inline)) void pair_avx2(const uint8_t *restrict w0, const uint8_t *restrict w1,
                                                            int k16, const float *restrict xf, int64_t xs,
                                                            const int R, float *restrict res, int64_t res_stride) {
    __m256 a0[8], a1[8];  /* tiles of at most 4 rows; 8 keeps the unused case 8 in bounds */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int c = 0; c < k16; c += 16) {
        if ((c & 63) == 0) prefetch_ahead(w0 + c, w1 + c, xs);
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
/* Weight rows w0, w1 against all m rows of x, in tiles; then the scalar tail past the vector
 * columns. xv: x laid out for the VBMI paths (bf16 rows if bf16, else permuted float rows), or NULL. */
static void pair_rows(const uint8_t *w0, const uint8_t *w1, int k, const float *xf, const void *xv, int bf16, int m,
                      float *res, int64_t rs) {
    const int kv = xv ? k & ~63 : k & ~15;
    static const int tiles[] = {PAIR_TILES};
    int r = 0;
    (void)bf16;
    for (size_t t = 0; t < sizeof(tiles) / sizeof(tiles[0]); t++) {
        const int R = tiles[t];
        for (; r + R <= m; r += R) {
#ifdef HAVE_BF16_DOT
            if (xv && bf16) {
                const uint16_t *xb = (const uint16_t *)xv + (int64_t)r * k;
                switch (R) {
                    case 8: pair_bf16(w0, w1, kv, xb, k, 8, res + r * rs, rs); break;
                    case 4: pair_bf16(w0, w1, kv, xb, k, 4, res + r * rs, rs); break;
                    case 2: pair_bf16(w0, w1, kv, xb, k, 2, res + r * rs, rs); break;
                    default: pair_bf16(w0, w1, kv, xb, k, 1, res + r * rs, rs); break;
                }
                continue;
            }
#endif
#ifdef HAVE_VBMI_DECODE
            if (xv) {
                const float *xp = (const float *)xv + (int64_t)r * k;
                switch (R) {
                    case 8: pair_vbmi_f32(w0, w1, kv, xp, k, 8, res + r * rs, rs); break;
                    case 4: pair_vbmi_f32(w0, w1, kv, xp, k, 4, res + r * rs, rs); break;
                    case 2: pair_vbmi_f32(w0, w1, kv, xp, k, 2, res + r * rs, rs); break;
                    default: pair_vbmi_f32(w0, w1, kv, xp, k, 1, res + r * rs, rs); break;
                }
                continue;
            }
#endif
            switch (R) {  /* constant R per call: the accumulators stay in registers */
                case 8: PAIR_KERNEL(w0, w1, kv, xf + (int64_t)r * k, k, 8, res + r * rs, rs); break;
                case 4: PAIR_KERNEL(w0, w1, kv, xf + (int64_t)r * k, k, 4, res + r * rs, rs); break;
                case 2: PAIR_KERNEL(w0, w1, kv, xf + (int64_t)r * k, k, 2, res + r * rs, rs); break;
                default: PAIR_KERNEL(w0, w1, kv, xf + (int64_t)r * k, k, 1, res + r * rs, rs); break;
            }
        }
    }
    const int k16 = kv;
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
    (void)scalar;
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
    /* the VBMI paths: x laid out in their column order (bf16 rows for the bf16 dot path, else float) */
    void *xv = NULL;
    int bf16 = 0;
    (void)bf16;
#ifdef HAVE_VBMI_DECODE
    if (simd && k >= 64) {
#ifdef HAVE_BF16_DOT
        bf16 = dtype == DT_BF16;
#endif
        const size_t el = bf16 ? 2 : 4;
        xv = malloc((size_t)m * k * el + 64);
        if (!xv) {
            free(xf);
            return -2;
        }
        const int k64 = k & ~63;
        for (int r = 0; r < m; r++) {
            if (bf16) {
                const uint16_t *src = (const uint16_t *)x + r * x_stride;
                uint16_t *dst = (uint16_t *)xv + (int64_t)r * k;
                for (int c = 0; c < k64; c += 64)
                    for (int i = 0; i < 64; i++) dst[c + i] = src[c + vbmi_column(i, 1)];
            } else {
                const float *src = xf + (int64_t)r * k;
                float *dst = (float *)xv + (int64_t)r * k;
                for (int c = 0; c < k64; c += 64)
                    for (int i = 0; i < 64; i++) dst[c + i] = src[c + vbmi_column(i, 0)];
            }
        }
    }
#endif
    const int pairs = (n + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && pairs > 1)
    for (int p = 0; p < pairs; p++) {
        const int r0 = 2 * p, r1 = r0 + 1 < n ? r0 + 1 : r0;
        const uint8_t *w0 = q + (int64_t)r0 * k, *w1 = q + (int64_t)r1 * k;
        if (simd) {
#ifdef PAIR_KERNEL
            pair_rows(w0, w1, k, xf, xv, bf16, m, res + r0, rs);
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
    free(xv);
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
