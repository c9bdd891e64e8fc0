/* Weight-only FP8 (e4m3fn) linear for CPU at a few rows: y[m, n] = scale[n] * sum_k x[m, k] * e4m3(q[n, k]);
 * and the same product over INT8 codes (devin_int8_linear: y[m, n] = scale[n] * sum_k x[m, k] * (int8)q[n, k]),
 * which shares the layout, the tiles and the threads and differs only in the decoder (the byte sign-extended
 * to 32 bits and converted to float: vpmovsxbd + vcvtdq2ps; the VBMI/BF16 paths are e4m3 only).
 *
 * Built and loaded by backends/fp8/cpu_fp8_linear.py (system C compiler, -O3 -march=native, OpenMP).
 * The torch reference (backends/fp8/kernels.py, kernel "reference") is the oracle; tests compare.
 *
 * Layout (built by cpu_fp8_linear.pack from the logical format of backends/fp8/format.py):
 *   qw     uint8 [np, kp / 64, 2, 64]: np = ceil(n / 2) pairs of weight rows, kp = k padded to a
 *          multiple of 64 with code 0 (+0.0); chunk c of pair p holds columns 64c..64c+63 of row
 *          2p, then the same columns of row 2p + 1 (a zero row past n). A pair is read as one
 *          sequential stream: reading its two rows side by side from the row-major layout halved
 *          the bandwidth a core gets from memory on the machine this was written on (~6 vs ~25 GB/s).
 *   scale  float32 [n]
 *   x      [m, x_stride] float32, bf16 or fp16 (first k columns used)
 *   out    [m, out_stride] in x's dtype (first n columns written)
 *
 * Decoding e4m3 -> float: the portable path reads a 256-entry table. The AVX2/AVX-512 paths place
 * the code's exponent and mantissa bits into a float16 (sign-extend the byte to 16 bits, shift
 * left by 7, clear bit 14): that float16 is exactly the e4m3 value / 256, subnormals included (both
 * formats have 3-bit mantissas, and the float16's exponent bias is 8 larger), and F16C's vcvtph2ps
 * widens 8 or 16 of them a instruction; float32 FMAs follow, and the factor 256 is applied once per
 * output with the row scale. With AVX512-VBMI, two vpermi2b table lookups decode 64 codes to bf16
 * at once (every e4m3 value is a bf16 value): bf16 activations with AVX512-BF16 multiply them with
 * vdpbf16ps, others widen them to float32 for FMAs. Float32 sums throughout: the result is
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
#if defined(HAVE_F16C_DECODE) && defined(HAVE_AVX512) && defined(__AVX512VBMI__)
#define HAVE_VBMI_DECODE 1
#ifdef __AVX512BF16__
#define HAVE_BF16_DOT 1
#endif
#endif

#define CH 64 /* columns per chunk */

static float LUT[256];
static int lut_ready = 0;

/* e4m3fn code -> float: sign, exponent bias 7, 3 mantissa bits, no infinities, NaN at 0x7F/0xFF. */
static float e4m3_value(int c) {
    const int e = (c >> 3) & 15, mt = c & 7;
    float v = e == 0 ? ldexpf((float)mt, -9) : ldexpf((float)(8 + mt), e - 10);
    if (e == 15 && mt == 7) v = NAN;
    return (c & 0x80) ? -v : v;
}

#ifdef HAVE_VBMI_DECODE
static uint8_t BF16_HI[128], BF16_LO[128]; /* the bf16 bytes of each magnitude's value */
#endif

static void init_lut(void) {
    if (__atomic_load_n(&lut_ready, __ATOMIC_ACQUIRE)) return;
    for (int c = 0; c < 256; c++) LUT[c] = e4m3_value(c);
#ifdef HAVE_VBMI_DECODE
    for (int c = 0; c < 128; c++) {
        uint32_t u;
        memcpy(&u, &LUT[c], 4);
        BF16_HI[c] = (uint8_t)(u >> 24);
        BF16_LO[c] = (uint8_t)(u >> 16);
    }
#endif
    __atomic_store_n(&lut_ready, 1, __ATOMIC_RELEASE);
}

/* ---- portable: one pair of weight rows against every row of x (xf rows kp apart) ----------- */
static inline float code_value(uint8_t c, int i8) { return i8 ? (float)(int8_t)c : LUT[c]; }

static void pair_scalar(const uint8_t *restrict w, int chunks, const float *restrict xf, int64_t xs, int m,
                        float *restrict res, int64_t rs, int i8) {
    const float f = i8 ? 1.0f : 1.0f / 256.0f; /* as the vector paths: e4m3 value / 256, int8 value */
    for (int r = 0; r < m; r++) {
        float s0 = 0.0f, s1 = 0.0f;
        for (int c = 0; c < chunks; c++)
            for (int j = 0; j < CH; j++) {
                const float xv = xf[r * xs + CH * c + j];
                s0 += xv * code_value(w[2 * CH * c + j], i8);
                s1 += xv * code_value(w[2 * CH * c + CH + j], i8);
            }
        res[r * rs] = s0 * f;
        res[r * rs + 1] = s1 * f;
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

/* 16 codes at p -> 16 floats in two vectors: e4m3 value / 256 (F16C), or the int8 value (I8). */
static inline __attribute__((always_inline)) void decode16_avx2(const uint8_t *p, const int I8, __m256 *lo, __m256 *hi) {
    const __m128i c = _mm_loadu_si128((const __m128i *)p);
    if (I8) {
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
    } else {
        const __m256i h = to_half_bits(c);
        *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
}
#endif

#if defined(HAVE_AVX512) && defined(HAVE_F16C_DECODE)
/* Row r of x's NA accumulators of each weight row, summed, reduced and multiplied by f. */
static inline __attribute__((always_inline)) void finish_pair(const __m512 *a0, const __m512 *a1, const int R,
                                                              const int NA, float f, float *restrict res, int64_t rs) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        __m512 s0 = a0[r * NA], s1 = a1[r * NA];
        for (int a = 1; a < NA; a++) {
            s0 = _mm512_add_ps(s0, a0[r * NA + a]);
            s1 = _mm512_add_ps(s1, a1[r * NA + a]);
        }
        res[r * rs] = _mm512_reduce_add_ps(s0) * f;
        res[r * rs + 1] = _mm512_reduce_add_ps(s1) * f;
    }
}

/* One pair (w: its chunks) x R rows of x: res[r * rs], res[r * rs + 1] get the sums / 256. */
static inline __attribute__((always_inline)) __m512 decode16_avx512(const uint8_t *p, const int I8) {
    const __m128i c = _mm_loadu_si128((const __m128i *)p);
    return I8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)) : _mm512_cvtph_ps(to_half_bits(c));
}

static inline __attribute__((always_inline)) void pair_avx512(const uint8_t *restrict w, int chunks,
                                                              const float *restrict xf, int64_t xs, const int R,
                                                              const int I8, float *restrict res, int64_t rs) {
    const int NA = R <= 2 ? 4 : 1; /* accumulators per row of x: few rows need more independent FMA chains */
    __m512 a0[8], a1[8];
#pragma GCC unroll 8
    for (int i = 0; i < R * NA; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
#pragma GCC unroll 4
        for (int s = 0; s < CH; s += 16) {
            const __m512 v0 = decode16_avx512(w + 2 * CH * c + s, I8);
            const __m512 v1 = decode16_avx512(w + 2 * CH * c + CH + s, I8);
            const int a = (s / 16) % NA;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_loadu_ps(xf + r * xs + CH * c + s);
                a0[r * NA + a] = _mm512_fmadd_ps(v0, xv, a0[r * NA + a]);
                a1[r * NA + a] = _mm512_fmadd_ps(v1, xv, a1[r * NA + a]);
            }
        }
    }
    finish_pair(a0, a1, R, NA, 1.0f, res, rs);
}
#define PAIR_TILES 8, 4, 2, 1
#define PAIR_KERNEL pair_avx512
#elif defined(HAVE_F16C_DECODE)
static inline __attribute__((always_inline)) void pair_avx2(const uint8_t *restrict w, int chunks,
                                                            const float *restrict xf, int64_t xs, const int R,
                                                            const int I8, float *restrict res, int64_t rs) {
    __m256 a0[8], a1[8]; /* tiles of at most 4 rows; 8 keeps the unused case 8 in bounds */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int c = 0; c < chunks; c++) {
#pragma GCC unroll 4
        for (int s = 0; s < CH; s += 16) {
            __m256 v0l, v0h, v1l, v1h;
            decode16_avx2(w + 2 * CH * c + s, I8, &v0l, &v0h);
            decode16_avx2(w + 2 * CH * c + CH + s, I8, &v1l, &v1h);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const float *xr = xf + r * xs + CH * c + s;
                const __m256 xl = _mm256_loadu_ps(xr), xh = _mm256_loadu_ps(xr + 8);
                a0[r] = _mm256_fmadd_ps(v0h, xh, _mm256_fmadd_ps(v0l, xl, a0[r]));
                a1[r] = _mm256_fmadd_ps(v1h, xh, _mm256_fmadd_ps(v1l, xl, a1[r]));
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        res[r * rs] = hsum8(a0[r]);
        res[r * rs + 1] = hsum8(a1[r]);
    }
}
#define PAIR_TILES 4, 2, 1
#define PAIR_KERNEL pair_avx2
#endif

#ifdef HAVE_VBMI_DECODE
/* VBMI: vpermi2b looks 64 codes up in two 128-entry byte tables (the bf16's high and low bytes of
 * each magnitude), the sign is OR-ed into the high bytes, and two byte interleaves give 64 bf16 in
 * two vectors: elements {0-7, 16-23, 32-39, 48-55} of the chunk, then {8-15, 24-31, ...}. Float32
 * activations widen those with a shift (even words) and an AND (odd words), four vectors in the
 * order of vbmi_column; x is laid out in the decoder's order once per call. */
static inline int vbmi_column(int i, int bf16) {
    if (bf16) return i < 32 ? (i / 8) * 16 + i % 8 : ((i - 32) / 8) * 16 + 8 + (i - 32) % 8;
    const int q = i / 16, p = i % 16; /* vector q, lane p: lane p / 4 of 128 bits, dword p % 4 */
    return 16 * (p / 4) + 2 * (p % 4) + (q & 1) + 8 * (q >> 1);
}

typedef struct {
    __m512i th0, th1, tl0, tl1, sign;
} vbmi_tables;

static inline vbmi_tables load_tables(void) {
    vbmi_tables t = {_mm512_loadu_si512(BF16_HI), _mm512_loadu_si512(BF16_HI + 64), _mm512_loadu_si512(BF16_LO),
                     _mm512_loadu_si512(BF16_LO + 64), _mm512_set1_epi8((char)0x80)};
    return t;
}

static inline __attribute__((always_inline)) void decode64(const uint8_t *w, const vbmi_tables *t, __m512i *b0,
                                                           __m512i *b1) {
    const __m512i codes = _mm512_loadu_si512(w);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->th0, codes, t->th1), codes, t->sign, 0xF8);
    const __m512i lo = _mm512_permutex2var_epi8(t->tl0, codes, t->tl1);
    *b0 = _mm512_unpacklo_epi8(lo, hi);
    *b1 = _mm512_unpackhi_epi8(lo, hi);
}

static inline __attribute__((always_inline)) void pair_vbmi_f32(const uint8_t *restrict w, int chunks,
                                                                const float *restrict xp, int64_t xs, const int R,
                                                                float *restrict res, int64_t rs) {
    const vbmi_tables t = load_tables();
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const int NA = 1; /* more accumulators measured no faster (4: slower) on this path */
    __m512 a0[8], a1[8];
#pragma GCC unroll 8
    for (int i = 0; i < R * NA; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        __m512 v[2][4];
        for (int j = 0; j < 2; j++) {
            __m512i b0, b1;
            decode64(w + 2 * CH * c + CH * j, &t, &b0, &b1);
            v[j][0] = _mm512_castsi512_ps(_mm512_slli_epi32(b0, 16));  /* even words: shifted up */
            v[j][1] = _mm512_castsi512_ps(_mm512_and_si512(b0, high));   /* odd words: already high */
            v[j][2] = _mm512_castsi512_ps(_mm512_slli_epi32(b1, 16));
            v[j][3] = _mm512_castsi512_ps(_mm512_and_si512(b1, high));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                const __m512 xv = _mm512_loadu_ps(xp + r * xs + CH * c + 16 * q);
                a0[r * NA + q % NA] = _mm512_fmadd_ps(v[0][q], xv, a0[r * NA + q % NA]);
                a1[r * NA + q % NA] = _mm512_fmadd_ps(v[1][q], xv, a1[r * NA + q % NA]);
            }
        }
    }
    finish_pair(a0, a1, R, NA, 1.0f / 256.0f, res, rs); /* the tables hold values: / 256 as the rest */
}

#ifdef HAVE_BF16_DOT
static inline __attribute__((always_inline)) void pair_bf16(const uint8_t *restrict w, int chunks,
                                                            const uint16_t *restrict xb, int64_t xs, const int R,
                                                            float *restrict res, int64_t rs) {
    const vbmi_tables t = load_tables();
    const int NA = R <= 2 ? 2 : 1;
    __m512 a0[8], a1[8];
#pragma GCC unroll 8
    for (int i = 0; i < R * NA; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        __m512i v[2][2];
        for (int j = 0; j < 2; j++) decode64(w + 2 * CH * c + CH * j, &t, &v[j][0], &v[j][1]);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xb + r * xs + CH * c);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xb + r * xs + CH * c + 32);
            __m512 *b0 = &a0[r * NA], *b1 = &a1[r * NA];
            b0[0] = _mm512_dpbf16_ps(b0[0], (__m512bh)v[0][0], x0);
            b1[0] = _mm512_dpbf16_ps(b1[0], (__m512bh)v[1][0], x0);
            b0[NA - 1] = _mm512_dpbf16_ps(b0[NA - 1], (__m512bh)v[0][1], x1);
            b1[NA - 1] = _mm512_dpbf16_ps(b1[NA - 1], (__m512bh)v[1][1], x1);
        }
    }
    finish_pair(a0, a1, R, NA, 1.0f / 256.0f, res, rs);
}
#endif
#endif

/* Which inner kernel runs: 0 portable, 1 F16C (AVX2/AVX-512; int8 codes: the same kernel's int8 decoder),
 * 2 VBMI float32, 3 VBMI bf16 dot (e4m3 only). */
enum { K_SCALAR = 0, K_F16C = 1, K_VBMI = 2, K_BF16 = 3 };

#define DISPATCH_R(CALL) \
    switch (R) {         \
        case 8: CALL(8); break; \
        case 4: CALL(4); break; \
        case 2: CALL(2); break; \
        default: CALL(1); break; \
    }

/* One pair against all m rows of x (xv: x in the chosen kernel's layout, rows kp apart), in tiles. */
static void pair_rows(int kind, int i8, const uint8_t *w, int chunks, const void *xv, int64_t kp, int m, float *res,
                      int64_t rs) {
    if (kind == K_SCALAR) {
        pair_scalar(w, chunks, (const float *)xv, kp, m, res, rs, i8);
        return;
    }
#ifdef PAIR_KERNEL
    static const int tiles[] = {PAIR_TILES};
    int r = 0;
    for (size_t t = 0; t < sizeof(tiles) / sizeof(tiles[0]); t++) {
        const int R = tiles[t];
        for (; r + R <= m; r += R) {
            const float *xf = (const float *)xv + r * kp;
            float *out = res + r * rs;
#ifdef HAVE_BF16_DOT
            if (kind == K_BF16) {
#define CALL(RR) pair_bf16(w, chunks, (const uint16_t *)xv + r * kp, kp, RR, out, rs)
                DISPATCH_R(CALL)
#undef CALL
                continue;
            }
#endif
#ifdef HAVE_VBMI_DECODE
            if (kind == K_VBMI) {
#define CALL(RR) pair_vbmi_f32(w, chunks, xf, kp, RR, out, rs)
                DISPATCH_R(CALL)
#undef CALL
                continue;
            }
#endif
            if (i8) {
#define CALL(RR) PAIR_KERNEL(w, chunks, xf, kp, RR, 1, out, rs)
                DISPATCH_R(CALL)
#undef CALL
                continue;
            }
#define CALL(RR) PAIR_KERNEL(w, chunks, xf, kp, RR, 0, out, rs)
            DISPATCH_R(CALL) /* constant R per call: the accumulators stay in registers */
#undef CALL
        }
    }
#endif
}

static int fp8_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q, const float *scale,
                      int n, void *out, int64_t out_stride, int num_threads, int scalar, int i8) {
    (void)scalar;
    if (m < 0 || n < 0 || k < 0) return -1;
    if (m == 0 || n == 0) return 0;
    init_lut();
    const int chunks = (k + CH - 1) / CH;
    const int64_t kp = (int64_t)chunks * CH;
    int kind = K_SCALAR;
#ifdef PAIR_KERNEL
    if (!scalar) kind = K_F16C;
#endif
#ifdef HAVE_VBMI_DECODE
    if (!scalar && !i8) kind = K_VBMI;
#endif
#ifdef HAVE_BF16_DOT
    if (!scalar && !i8 && dtype == DT_BF16) kind = K_BF16;
#endif
    /* xf [m, kp] (x in float, zero past k) | xv [m, kp] (the VBMI kernels' order) | res [m, n + 1] (a
     * spare column: the zero row of an odd last pair) */
    const int64_t rs = (int64_t)n + 1;
    float *xf = malloc(((size_t)m * kp * 2 + (size_t)m * rs) * sizeof(float) + 64);
    if (!xf) return -2;
    float *xp = xf + (size_t)m * kp, *res = xp + (size_t)m * kp;
    for (int r = 0; r < m; r++) {
        load_row(x, r * x_stride, dtype, k, xf + r * kp);
        memset(xf + r * kp + k, 0, (size_t)(kp - k) * sizeof(float));
    }
    const void *xv = xf;
#ifdef HAVE_VBMI_DECODE
    if (kind == K_VBMI || kind == K_BF16) {
        const int bf16 = kind == K_BF16;
        uint16_t *xb = (uint16_t *)xp;
        for (int r = 0; r < m; r++)
            for (int64_t c = 0; c < kp; c += CH)
                for (int i = 0; i < CH; i++) {
                    const float v = xf[r * kp + c + vbmi_column(i, bf16)];
                    if (bf16) { /* exact: x was bf16 (the zero padding too) */
                        uint32_t u;
                        memcpy(&u, &v, 4);
                        xb[r * kp + c + i] = (uint16_t)(u >> 16);
                    } else {
                        xp[r * kp + c + i] = v;
                    }
                }
        xv = xp;
    }
#endif
    const int pairs = (n + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && pairs > 1)
    for (int p = 0; p < pairs; p++) {
        const int r0 = 2 * p;
        pair_rows(kind, i8, q + (int64_t)p * 2 * kp, chunks, xv, kp, m, res + r0, rs);
        const float unit = i8 ? 1.0f : 256.0f; /* the e4m3 decoders give value / 256 */
        const float s0 = unit * scale[r0], s1 = r0 + 1 < n ? unit * scale[r0 + 1] : 0.0f;
        for (int i = 0; i < m; i++) {
            res[i * rs + r0] *= s0;
            res[i * rs + r0 + 1] *= s1;
        }
    }
    for (int r = 0; r < m; r++) store_row(out, r * out_stride, dtype, n, res + r * rs);
    free(xf);
    return 0;
}

/* Returns 0, or a negative code for arguments it cannot take. q: the pair layout above. */
int devin_fp8_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q, const float *scale,
                     int n, void *out, int64_t out_stride, int num_threads) {
    return fp8_linear(x, x_stride, m, k, dtype, q, scale, n, out, out_stride, num_threads, 0, 0);
}

/* The same product by the portable (table) path only: tests check the vector paths against it. */
int devin_fp8_linear_scalar(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q,
                            const float *scale, int n, void *out, int64_t out_stride) {
    return fp8_linear(x, x_stride, m, k, dtype, q, scale, n, out, out_stride, 1, 1, 0);
}

/* The same products over INT8 codes (two's complement bytes, same pair layout): y = scale[n] * sum x * q. */
int devin_int8_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q, const float *scale,
                      int n, void *out, int64_t out_stride, int num_threads) {
    return fp8_linear(x, x_stride, m, k, dtype, q, scale, n, out, out_stride, num_threads, 0, 1);
}

int devin_int8_linear_scalar(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *q,
                             const float *scale, int n, void *out, int64_t out_stride) {
    return fp8_linear(x, x_stride, m, k, dtype, q, scale, n, out, out_stride, 1, 1, 1);
}

/* e4m3 codes -> floats through the F16C decoder (AVX2/AVX-512 builds) or the table: tests compare
 * all 256 codes against torch's float8_e4m3fn. */
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

/* Which vector code this build runs: 3 = AVX-512 VBMI (+ BF16 dot), 2 = AVX-512, 1 = AVX2, 0 = portable. */
int devin_fp8_simd(void) {
#if defined(HAVE_VBMI_DECODE)
    return 3;
#elif defined(HAVE_AVX512) && defined(HAVE_F16C_DECODE)
    return 2;
#elif defined(HAVE_F16C_DECODE)
    return 1;
#else
    return 0;
#endif
}
