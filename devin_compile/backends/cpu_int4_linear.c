/* Weight-only INT4 linear for CPU at a few rows: y[m, n] = sum_k x[m, k] * w[n, k],
 * w[n, k] = q[n, k] * scale[n, k / g] + minv[n, k / g].
 *
 * Built and loaded by cpu_int4_linear.py (system C compiler, -O3 -march=native, OpenMP).
 * The torch reference (backends/int4.py, kernel "reference") is the oracle; tests compare.
 *
 * Layout:
 *   x     [m, x_stride] float32, bf16 or fp16 (first k columns used)
 *   qw    uint8 [n, kq / 2], kq = k padded to whole groups and then to a multiple of 64. Each
 *         64 columns of a row ("unit") are 32 bytes = eight 32-bit lanes; lane i holds columns
 *         i, 8 + i, ..., 56 + i of the unit, column 8t + i in bits 4t .. 4t + 3
 *   sz    float32 [n, groups, 2]: (scale, minv) of each group of each row
 *   out   [m, out_stride] in x's dtype (first n columns written)
 *
 * At a few rows this is a matrix-vector product: its time is reading the weights plus turning
 * nibbles into floats, and the layout makes the second cheap. Masking a loaded unit with
 * 0xF << 4t leaves q * 2^4t in each lane, columns 8t .. 8t + 7 in order; converting that to
 * float is exact, and the 2^-4t is folded into x once per call (exact too: a power of two), so
 * each 8 weights cost an AND, a convert and one FMA per row of x, with no shuffles. (Nibble 7
 * is shifted down 4 bits first, so the int32 stays positive.) A group contributes
 * scale * sum(q * x) + minv * sum(x), the second sum also taken once per call. Each unpacked
 * unit serves up to 4 rows of x (the tile); threads split the output columns. Float32
 * arithmetic throughout: the result matches "dequantize, then an fp32 matmul" up to rounding
 * order.
 *
 * bf16/fp16 activations at one row (batch-1 decode) take integer dot products instead
 * (see "int16 activations" below): each group of x is rounded to int16 against its largest
 * |x| (an error of at most max|x| / 65534 per element, below bf16's own rounding of the group's
 * larger elements and of the output), and a group's sum of q * x is exact in int32. Float32 activations always take the
 * float path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

#define ROWS_PER_TASK 16

#ifdef HAVE_AVX2
/* x's per-column factor for the lane trick: 2^-4t for nibble t < 7, 2^-24 for nibble 7. */
static inline float column_factor(int64_t c) {
    const int t = (int)(c % 64) / 8;
    return t == 7 ? 0x1p-24f : 1.0f / (float)(1u << (4 * t));
}

/* res[r] = x_r . w_row for the MT rows of x at xs (scaled x, row stride kq), NA accumulators
 * per row; GS (the group size) is a compile-time constant in each instantiation. */
static inline __attribute__((always_inline)) void dot_tile(const uint8_t *restrict wrow, const float *restrict szrow,
                                                           int groups, const float *restrict xs, int64_t kq,
                                                           const float *restrict xsum, const int GS, const int MT,
                                                           const int NA, float *restrict res) {
    __m256 acc[4], p[4][4];
    float zsum[4];
    for (int r = 0; r < MT; r++) {
        acc[r] = _mm256_setzero_ps();
        zsum[r] = 0.0f;
        for (int a = 0; a < NA; a++) p[r][a] = _mm256_setzero_ps();
    }
    const int units = (int)(kq / 64);
    int g = 0;
    for (int u = 0; u < units; u++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wrow + 32 * u));
        const __m256i v7 = _mm256_srli_epi32(v, 4);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m256i qi = t == 7 ? _mm256_and_si256(v7, _mm256_set1_epi32(0x0F000000))
                                      : _mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * t)));
            const __m256 wf = _mm256_cvtepi32_ps(qi);
#pragma GCC unroll 4
            for (int r = 0; r < MT; r++)
                p[r][t % NA] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xs + r * kq + 64 * u + 8 * t), p[r][t % NA]);
            /* a group ends after this nibble: fold its partial sums in with its scale */
            const int ends = GS == 32 ? (t == 3 || t == 7) : t == 7 && (GS == 64 || (u & 1));
            if (ends && g < groups) {
                const __m256 s = _mm256_set1_ps(szrow[2 * g]);
                const float z = szrow[2 * g + 1];
                for (int r = 0; r < MT; r++) {
                    __m256 sum = p[r][0];
                    for (int a = 1; a < NA; a++) sum = _mm256_add_ps(sum, p[r][a]);
                    acc[r] = _mm256_fmadd_ps(sum, s, acc[r]);
                    zsum[r] += z * xsum[r * groups + g];
                    for (int a = 0; a < NA; a++) p[r][a] = _mm256_setzero_ps();
                }
                g++;
            }
        }
    }
    for (int r = 0; r < MT; r++) res[r] = hsum8(acc[r]) + zsum[r];
}

static inline __attribute__((always_inline)) void dot_tile_gs(const uint8_t *restrict wrow,
                                                              const float *restrict szrow, int groups, int gs,
                                                              const float *restrict xs, int64_t kq,
                                                              const float *restrict xsum, const int MT, const int NA,
                                                              float *restrict res) {
    if (gs == 32)
        dot_tile(wrow, szrow, groups, xs, kq, xsum, 32, MT, NA, res);
    else if (gs == 64)
        dot_tile(wrow, szrow, groups, xs, kq, xsum, 64, MT, NA, res);
    else
        dot_tile(wrow, szrow, groups, xs, kq, xsum, 128, MT, NA, res);
}
#endif

/* Portable version for one row of x (xr: unscaled x, zero-padded to kq). */
static float dot_scalar(const uint8_t *restrict wrow, const float *restrict szrow, int groups, int gs,
                        const float *restrict xr) {
    float sum = 0.0f;
    for (int g = 0; g < groups; g++) {
        const float s = szrow[2 * g], z = szrow[2 * g + 1];
        for (int c = g * gs; c < (g + 1) * gs; c++) {
            const int i = c % 8, t = (c % 64) / 8;
            const uint8_t byte = wrow[32 * (c / 64) + 4 * i + t / 2];
            const int q = t % 2 ? byte >> 4 : byte & 15;
            sum += xr[c] * ((float)q * s + z);
        }
    }
    return sum;
}

static void store_value(void *out, int64_t off, int dt, float v) { store_row(out, off, dt, 1, &v); }

static int bad_args(int m, int n, int k, int groups, int group_size) {
    const int64_t kp = (int64_t)groups * group_size;
    return m < 0 || n < 0 || (group_size != 32 && group_size != 64 && group_size != 128) || kp < k ||
           kp - k >= group_size;
}

/* ---- int16 activations ---------------------------------------------------------------------
 *
 * The float path spends an AND, an int->float convert and an FMA on every 8 weights and is
 * bound by them (~4 weights a cycle on this CPU). Here x is rounded per group to int16,
 * xi = round(x / dx) with dx = max|x| / 32767, and a unit of 64 weights costs: one load, three
 * ops to split the nibbles into two byte vectors (lo: nibble t even, hi: t odd), four unpacks to
 * int16, four madd (int16 x int16 pairs -> int32) against x, three adds, then per group one
 * convert and a multiply by scale * dx. The zero-point term, minv * sum(x), uses the unrounded x.
 *
 * xq order, per unit: the unpacks leave the bytes of lo/hi in the order [0..7, 16..23] (unpacklo)
 * and [8..15, 24..31] (unpackhi); byte p = 4i + b of a weight lane vector holds column 16b + i
 * (lo) or 16b + 8 + i (hi). So column c of unit u sits at xq[64u + int16_slot(c)], in one of the
 * four int16 vectors v = 2 * (hi) + (unpackhi). madd sums elements (2j, 2j+1), which share b / 2,
 * so for group size 32 the even int32 lanes are the unit's first group and the odd lanes its second.
 * One row only: at 2 rows the float path's 2-row tile was measured as fast.
 */
#ifdef HAVE_AVX2
static inline int int16_slot(int c) { /* c: column within a unit, 0..63 */
    const int b = c / 16, h = (c % 16) / 8, i = c % 8, p = 4 * i + b;
    return 16 * (2 * h + (p % 16) / 8) + p % 8 + (p >= 16 ? 8 : 0);
}

/* One row of x (float, zero-padded to kq) -> xq [kq] int16 in the order above (0 past the
 * groups), dx [groups] and xsum2 [groups, 2] = (0, the group's sum of x: lines up with the
 * (scale, minv) pairs of a weight row). */
static void quantize_x_int16(const float *restrict xr, int64_t kq, int groups, int gs, int16_t *restrict xq,
                             float *restrict dx, float *restrict xsum2) {
    memset(xq, 0, (size_t)kq * sizeof(int16_t));
    for (int g = 0; g < groups; g++) {
        float amax = 0.0f, sum = 0.0f;
        for (int c = g * gs; c < (g + 1) * gs; c++) {
            const float a = fabsf(xr[c]);
            amax = a > amax ? a : amax;
            sum += xr[c];
        }
        xsum2[2 * g] = 0.0f;
        xsum2[2 * g + 1] = sum;
        dx[g] = amax / 32767.0f;
        const float inv = dx[g] > 0.0f ? 1.0f / dx[g] : 0.0f;
        for (int c = g * gs; c < (g + 1) * gs; c++) {
            const float q = nearbyintf(xr[c] * inv); /* round half to even, as torch.round */
            xq[64 * (c / 64) + int16_slot(c % 64)] = (int16_t)(q > 32767.0f ? 32767.0f : q < -32767.0f ? -32767.0f : q);
        }
    }
}

/* x . w_row for x in int16 form; GS is a compile-time constant per instantiation. */
static inline __attribute__((always_inline)) float dot_int16(const uint8_t *restrict wrow, const float *restrict szrow,
                                                             int groups, const int16_t *restrict xq, int64_t kq,
                                                             const float *restrict dx, const float *restrict xsum2,
                                                             const int GS) {
    const __m256i low = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256i carry = zero; /* group size 128: the first unit's sums */
    const int units = (int)(kq / 64);
    for (int u = 0; u < units; u++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wrow + 32 * u));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        const __m256i *x = (const __m256i *)(xq + 64 * u);
        __m256i s = _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), _mm256_loadu_si256(x));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), _mm256_loadu_si256(x + 1)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), _mm256_loadu_si256(x + 2)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), _mm256_loadu_si256(x + 3)));
        if (GS == 32) {
            const int g = 2 * u;
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_blend_epi32(s, zero, 0xAA)),
                                   _mm256_set1_ps(szrow[2 * g] * dx[g]), acc0);
            if (g + 1 < groups)
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_blend_epi32(zero, s, 0xAA)),
                                       _mm256_set1_ps(szrow[2 * g + 2] * dx[g + 1]), acc1);
        } else if (GS == 64) {
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(szrow[2 * u] * dx[u]));
            if (u & 1)
                acc1 = _mm256_add_ps(acc1, t);
            else
                acc0 = _mm256_add_ps(acc0, t);
        } else if (u & 1) {
            const int g = u / 2;
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(carry, s)), _mm256_set1_ps(szrow[2 * g] * dx[g]),
                                   acc0);
        } else {
            carry = s;
        }
    }
    /* + sum_g minv_g * xsum_g, 4 groups per vector */
    __m256 z = _mm256_setzero_ps();
    float tail = 0.0f;
    int e = 0;
    for (; e + 8 <= 2 * groups; e += 8) z = _mm256_fmadd_ps(_mm256_loadu_ps(szrow + e), _mm256_loadu_ps(xsum2 + e), z);
    for (; e < 2 * groups; e++) tail += szrow[e] * xsum2[e];
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), z)) + tail;
}

static int int4_linear_int16(const void *x, int k, int dtype, const uint8_t *qw, const float *sz, int n,
                             int groups, int group_size, void *out, int num_threads) {
    const int64_t kq = ((int64_t)groups * group_size + 63) / 64 * 64;
    float *xf = aligned_alloc(64, (size_t)((kq + 3 * groups) * sizeof(float) + 63) / 64 * 64);
    int16_t *xq = aligned_alloc(64, (size_t)(kq * sizeof(int16_t) + 63) / 64 * 64);
    if (!xf || !xq) {
        free(xf);
        free(xq);
        return -2;
    }
    float *dx = xf + kq, *xsum2 = dx + groups;
    load_row(x, 0, dtype, k, xf);
    memset(xf + k, 0, (size_t)(kq - k) * sizeof(float));
    quantize_x_int16(xf, kq, groups, group_size, xq, dx, xsum2);
    const int tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        const int n1 = (task + 1) * ROWS_PER_TASK < n ? (task + 1) * ROWS_PER_TASK : n;
        for (int j = task * ROWS_PER_TASK; j < n1; j++) {
            const uint8_t *wrow = qw + (int64_t)j * (kq / 2);
            const float *szrow = sz + (int64_t)j * groups * 2;
            const float v = group_size == 32   ? dot_int16(wrow, szrow, groups, xq, kq, dx, xsum2, 32)
                            : group_size == 64 ? dot_int16(wrow, szrow, groups, xq, kq, dx, xsum2, 64)
                                               : dot_int16(wrow, szrow, groups, xq, kq, dx, xsum2, 128);
            store_value(out, j, dtype, v);
        }
    }
    free(xf);
    free(xq);
    return 0;
}
#endif

/* The float path (any dtype, any row count). */
static int int4_linear_float(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw,
                             const float *sz, int n, int groups, int group_size, void *out, int64_t out_stride,
                             int num_threads) {
    const int64_t kp = (int64_t)groups * group_size, kq = (kp + 63) / 64 * 64;
    float *xs = aligned_alloc(64, (size_t)(((m * (kq + groups) * sizeof(float)) + 63) / 64 * 64));
    if (!xs) return -2;
    float *xsum = xs + m * kq; /* [m, groups]: each group's sum of x */
    for (int r = 0; r < m; r++) {
        float *row = xs + r * kq;
        load_row(x, r * x_stride, dtype, k, row);
        memset(row + k, 0, (size_t)(kq - k) * sizeof(float));
        for (int g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int c = g * group_size; c < (g + 1) * group_size; c++) sum += row[c];
            xsum[r * groups + g] = sum;
        }
#ifdef HAVE_AVX2
        for (int64_t c = 0; c < kq; c++) row[c] *= column_factor(c);
#endif
    }
    const int tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        const int n1 = (task + 1) * ROWS_PER_TASK < n ? (task + 1) * ROWS_PER_TASK : n;
        for (int j = task * ROWS_PER_TASK; j < n1; j++) {
            const uint8_t *wrow = qw + (int64_t)j * (kq / 2);
            const float *szrow = sz + (int64_t)j * groups * 2;
            float res[4];
            int r = 0;
#ifdef HAVE_AVX2
            for (; r + 4 <= m; r += 4) {
                dot_tile_gs(wrow, szrow, groups, group_size, xs + r * kq, kq, xsum + r * groups, 4, 2, res);
                for (int i = 0; i < 4; i++) store_value(out, (r + i) * out_stride + j, dtype, res[i]);
            }
            for (; r + 2 <= m; r += 2) {
                dot_tile_gs(wrow, szrow, groups, group_size, xs + r * kq, kq, xsum + r * groups, 2, 4, res);
                for (int i = 0; i < 2; i++) store_value(out, (r + i) * out_stride + j, dtype, res[i]);
            }
            for (; r < m; r++) {
                dot_tile_gs(wrow, szrow, groups, group_size, xs + r * kq, kq, xsum + r * groups, 1, 4, res);
                store_value(out, r * out_stride + j, dtype, res[0]);
            }
#else
            for (; r < m; r++)
                store_value(out, r * out_stride + j, dtype, dot_scalar(wrow, szrow, groups, group_size, xs + r * kq));
#endif
        }
    }
    free(xs);
    return 0;
}

/* Returns 0, or a negative code for arguments it cannot take (the caller checks them first). */
int devin_int4_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw, const float *sz,
                      int n, int groups, int group_size, void *out, int64_t out_stride, int num_threads) {
    if (bad_args(m, n, k, groups, group_size)) return -1;
    if (m == 0 || n == 0) return 0;
#ifdef HAVE_AVX2
    if (dtype != DT_F32 && m == 1)
        return int4_linear_int16(x, k, dtype, qw, sz, n, groups, group_size, out, num_threads);
#endif
    return int4_linear_float(x, x_stride, m, k, dtype, qw, sz, n, groups, group_size, out, out_stride, num_threads);
}

/* The float path only, at any dtype and row count (tests and benchmarks compare the two). */
int devin_int4_linear_float(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw,
                            const float *sz, int n, int groups, int group_size, void *out, int64_t out_stride,
                            int num_threads) {
    if (bad_args(m, n, k, groups, group_size)) return -1;
    if (m == 0 || n == 0) return 0;
    return int4_linear_float(x, x_stride, m, k, dtype, qw, sz, n, groups, group_size, out, out_stride, num_threads);
}

/* The same product by the portable path only (tests check the vector path against it). */
int devin_int4_linear_scalar(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw,
                             const float *sz, int n, int groups, int group_size, void *out, int64_t out_stride) {
    if (bad_args(m, n, k, groups, group_size)) return -1;
    const int64_t kp = (int64_t)groups * group_size, kq = (kp + 63) / 64 * 64;
    float *xr = calloc((size_t)kq, sizeof(float));
    if (!xr) return -2;
    for (int r = 0; r < m; r++) {
        load_row(x, r * x_stride, dtype, k, xr);
        for (int j = 0; j < n; j++)
            store_value(out, r * out_stride + j, dtype,
                        dot_scalar(qw + (int64_t)j * (kq / 2), sz + (int64_t)j * groups * 2, groups, group_size, xr));
    }
    free(xr);
    return 0;
}
