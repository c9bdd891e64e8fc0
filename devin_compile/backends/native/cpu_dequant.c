/* Dequantize blocks of 16 rows of a quantized weight into a dense tile, for long steps (prefill).
 *
 * Built and loaded by backends/dequant.py (system C compiler, -O3 -march=native). A step of
 * many rows runs a quantized linear as "dequantize a tile of the weight into a reused scratch
 * buffer, then a dense GEMM on it", so no dense copy of a quantized weight is kept between steps.
 * The values equal torch's dequantization bit for bit (oracles: backends/int4/format.py dequantize,
 * backends/fp8/format.py dequantize): float32 products and sums rounded as torch rounds them
 * (-std=c11 compiles without fused multiply-adds), then one round-to-nearest-even to the dtype.
 *
 * Tiles are "transposed": block b's 16 rows become 16 consecutive values at each column k,
 *   out + (b - b0) * block_stride + k * k_stride + r     (r: the row within the block),
 * so block_stride = 16 * k, k_stride = 16 gives devin::packed_gemm_linear's [nb, k, 16] layout, and
 * block_stride = 16, k_stride = 16 * nb a plain [k, 16 * nb] matrix (the weight transposed) for a GEMM.
 * Rows past n (the layouts' padding) come out as zeros.
 *
 * INT4, the "cpu_c" layout of backends/int4/cpu_int4_linear.py:
 *   qw  uint8 [nb, kp * 8]: chunk c (64 bytes) of block b holds 4 bytes per row r, byte j's low nibble
 *       column 8c + j and its high nibble column 8c + 4 + j of row 16b + r: loaded as 16 uint32 lanes,
 *       lane r is row r, and each nibble position is one column for all 16 rows;
 *   sz  float32 [nb, groups, 2, 16]: each group's 16 scales, then its 16 minimums: w = q * scale + min.
 * FP8, the pair layout of backends/fp8/cpu_fp8_linear.py:
 *   qw  uint8 [ceil(n / 2), kp / 64, 2, 64]: 64-column chunks of rows 2p and 2p + 1 side by side;
 *   scale float32 [n]: w = e4m3(q) * scale.
 * dtype: DT_F32, DT_BF16 or DT_F16 (cpu_kernels.h). Returns 0, or -1 for arguments out of range.
 * One thread: the INT4 loop writes a tile at memory speed (SmolLM2's gate+up, 7 MB of float32, in
 * ~0.1 ms), far below the GEMM that follows, and a parallel region costs more than that whenever
 * the CPU is shared (a thread waits for its sibling to be scheduled).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define ROWS 16
#define CH 64

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* 16 float32 values to dtype at p (bf16: round to nearest even, NaN kept quiet; as torch casts). */
static inline void store16(void *base, int64_t off, int dt, v16f v) {
    if (dt == DT_F32) {
        memcpy((float *)base + off, &v, sizeof v);
    } else if (dt == DT_BF16) {
        v16u u;
        memcpy(&u, &v, sizeof u);
        const v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
        const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const v16u r = (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);
        const v16h h = __builtin_convertvector(r, v16h);
        memcpy((uint16_t *)base + off, &h, sizeof h);
    } else {
        float f[ROWS];
        memcpy(f, &v, sizeof f);
        store_row(base, off, dt, ROWS, f);
    }
}

static int bad_common(int n, int k, int b0, int nb, int dtype) {
    return n <= 0 || k <= 0 || b0 < 0 || nb < 0 || (int64_t)(b0 + nb) * ROWS >= (int64_t)n + ROWS ||
           dtype < DT_F32 || dtype > DT_F16;
}

int devin_int4_dequant(const uint8_t *qw, const float *sz, int n, int k, int groups, int group_size, int b0, int nb,
                       int dtype, void *out, int64_t block_stride, int64_t k_stride) {
    if (bad_common(n, k, b0, nb, dtype) || groups <= 0 || group_size % 8 || (int64_t)groups * group_size < k)
        return -1;
    const int kp = groups * group_size, cpg = group_size / 8;
    for (int i = 0; i < nb; i++) {
        const int b = b0 + i;
        const uint8_t *blk = qw + (int64_t)b * kp * 8;
        const float *bsz = sz + (int64_t)b * groups * 2 * ROWS;
        const int64_t base = (int64_t)i * block_stride;
        for (int g = 0; g < groups; g++) {
            v16f s, mn;
            memcpy(&s, bsz + g * 2 * ROWS, sizeof s);
            memcpy(&mn, bsz + (g * 2 + 1) * ROWS, sizeof mn);
            for (int c = g * cpg; c < (g + 1) * cpg && 8 * c < k; c++) {
                v16u v;
                memcpy(&v, blk + (int64_t)c * CH, sizeof v);
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {  /* t < 4: byte t's low nibble; t >= 4: byte t - 4's high one */
                    const int col = 8 * c + t;
                    if (col >= k) break;
                    const v16u q = (v >> (8 * (t & 3) + 4 * (t >> 2))) & 15u;
                    const v16f prod = __builtin_convertvector(q, v16f) * s; /* two roundings, as torch's */
                    store16(out, base + col * k_stride, dtype, prod + mn);
                }
            }
        }
    }
    return 0;
}

#if defined(HAVE_AVX2) && defined(__F16C__)
/* 16 e4m3 codes -> value / 256 (cpu_fp8_linear.c's decoder: the byte sign-extended to 16 bits,
 * shifted left by 7, bit 14 cleared, is the float16 of value / 256, subnormals included; the NaN
 * codes, which quantize never writes, come out as 480). */
static inline v16f decode16(const uint8_t *p) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xBFFF));
    v16f v;
#ifdef HAVE_AVX512
    const __m512 f = _mm512_cvtph_ps(h);
    memcpy(&v, &f, sizeof v);
#else
    const __m256 f0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), f1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    memcpy(&v, &f0, sizeof f0);
    memcpy((float *)&v + 8, &f1, sizeof f1);
#endif
    return v;
}
#else
/* e4m3fn code -> float: sign, exponent bias 7, 3 mantissa bits (NaN codes as the vector path: 480). */
static float e4m3_value(int c) {
    const int e = (c >> 3) & 15, mt = c & 7;
    const float v = e == 0 ? ldexpf((float)mt, -9) : ldexpf((float)(8 + mt), e - 10);
    return (c & 0x80) ? -v : v;
}

static inline v16f decode16(const uint8_t *p) {
    float f[ROWS];
    for (int j = 0; j < ROWS; j++) f[j] = e4m3_value(p[j]) * (1.0f / 256.0f);
    v16f v;
    memcpy(&v, f, sizeof v);
    return v;
}
#endif

/* Transpose 16 rows of 16 floats in place: at each level h = 8, 4, 2, 1 the h x h blocks off the
 * diagonal of every 2h x 2h block swap (a two-source permutation: one vpermt2ps with AVX-512). */
static inline void transpose16(v16f *m) {
    static const v16u lo_idx[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                   {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                                   {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                                   {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
    static const v16u hi_idx[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                                   {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                                   {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                                   {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
    for (int level = 0, h = 8; level < 4; level++, h /= 2)
        for (int r = 0; r < ROWS; r++) {
            if (r & h) continue;
            const v16f a = m[r], b = m[r + h];
            m[r] = __builtin_shuffle(a, b, lo_idx[level]);
            m[r + h] = __builtin_shuffle(a, b, hi_idx[level]);
        }
}

int devin_fp8_dequant(const uint8_t *qw, const float *scale, int n, int k, int b0, int nb, int dtype, void *out,
                      int64_t block_stride, int64_t k_stride) {
    if (bad_common(n, k, b0, nb, dtype)) return -1;
    const int kp = (k + CH - 1) / CH * CH;
    for (int i = 0; i < nb; i++) {
        const int row0 = (b0 + i) * ROWS;
        const int live = n - row0 < ROWS ? n - row0 : ROWS; /* rows past n: zeros */
        const uint8_t *row[ROWS];
        float s256[ROWS];
        for (int r = 0; r < live; r++) {
            row[r] = qw + (int64_t)((row0 + r) / 2) * 2 * kp + ((row0 + r) % 2) * CH;
            s256[r] = 256.0f * scale[row0 + r]; /* exact: (value / 256) * (256 scale) rounds as value * scale */
        }
        for (int col0 = 0; col0 < k; col0 += ROWS) {
            v16f sq[ROWS]; /* a 16 x 16 square: row r's 16 columns, then transposed in place */
            const int64_t at = (int64_t)(col0 / CH) * 2 * CH + col0 % CH;
            for (int r = 0; r < ROWS; r++) sq[r] = r < live ? decode16(row[r] + at) * s256[r] : (v16f){0};
            transpose16(sq);
            const int cols = k - col0 < ROWS ? k - col0 : ROWS;
            for (int j = 0; j < cols; j++)
                store16(out, (int64_t)i * block_stride + (int64_t)(col0 + j) * k_stride, dtype, sq[j]);
        }
    }
    return 0;
}
