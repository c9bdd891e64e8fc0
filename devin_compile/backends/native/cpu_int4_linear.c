/* Weight-only INT4 linear for CPU at a few rows: y[m, n] = sum_k x[m, k] * w[n, k],
 * w[n, k] = q[n, k] * scale[n, k / g] + minv[n, k / g].
 *
 * Built and loaded by cpu_int4_linear.py (system C compiler, -O3 -march=native, OpenMP).
 * The torch reference (backends/int4/kernels.py, kernel "reference") is the oracle; tests compare.
 *
 * Layout: weight rows are interleaved in blocks of 16, so one vector holds the same columns of
 * 16 rows and its lanes accumulate 16 outputs at once (no horizontal sums, one vector store):
 *   qw    uint8 [nb, kp / 8, 16, 4], nb = ceil(n / 16), kp = k padded to whole groups: chunk c of
 *         block b holds, for each of its 16 rows r, 4 bytes; byte j's low nibble is column
 *         8c + j and its high nibble column 8c + 4 + j of row 16b + r (rows past n are zero)
 *   sz    float32 [nb, groups, 2, 16]: the scales, then the minimums, of the block's 16 rows
 *   x     [m, x_stride] float32, bf16 or fp16 (first k columns used)
 *   out   [m, out_stride] in x's dtype (first n columns written)
 * A 32-bit lane of a chunk is one row's 8 nibbles, so masking nibble pairs out of a 64-byte
 * chunk gives 16 rows x 4 consecutive columns as bytes: what VNNI's vpdpbusd multiplies (four
 * u8 x s8 products summed into each int32 lane) against 4 columns of x broadcast to every lane.
 *
 * Two paths (each with AVX-512 and AVX2 code, and a portable one for the rest):
 * - integer (bf16/fp16 activations, the decode case): each group of each row of x is rounded
 *   to int16 against its largest |x|, x16 = round(x / dx), dx = max|x| / 32639 (an error of at
 *   most max|x| / 65278 per element, below bf16's own rounding of the group's larger elements),
 *   split into two signed bytes x16 = 256 * xh + xl, and a group's sum of q * x16 is exact in
 *   int32: AVX-512 VNNI vpdpbusd, or AVX2 vpmaddubsw (u8 x s8 pairs into int16: no
 *   saturation, since |q| <= 15 and |xh|, |xl| <= 128) and vpmaddwd. Per group:
 *   scale * dx * sum(q * x16) + minv * sum(x), the second sum over the unrounded x.
 * - float (float32 activations, or forced): masking nibble t of a lane with 0xF << 4t and
 *   converting gives q * 2^4t exactly; x is multiplied by 2^-4t once per call (exact: a power
 *   of two), so 16 rows x 1 column cost an AND, a convert and one FMA per row of x. (Nibble 7
 *   is shifted down first, so the int32 stays positive.) Float32 arithmetic throughout: the
 *   result matches "dequantize, then an fp32 matmul" up to rounding order.
 * Each loaded chunk serves up to 4 rows of x; threads split the blocks.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

#define BR 16        /* weight rows per block */
#define X16_MAX 32639 /* 127 * 256 + 127: the largest |x16| whose two bytes are both signed bytes */

enum { MODE_AUTO = 0, MODE_FLOAT = 1 };

static int bad_args(int m, int n, int k, int groups, int group_size) {
    const int64_t kp = (int64_t)groups * group_size;
    return m < 0 || n < 0 || (group_size != 32 && group_size != 64 && group_size != 128) || kp < k ||
           kp - k >= group_size;
}

/* ---- activations, once per call ---------------------------------------------------------- */

/* Scale factor of column c for the float path's masks: 2^-4t for nibble t of its lane. */
static inline float column_factor(int64_t c) {
    const int j = (int)(c % 8), t = j < 4 ? 2 * j : 2 * (j - 4) + 1;
    return t == 7 ? 0x1p-24f : 1.0f / (float)(1u << (4 * t));
}

/* Row r of x -> xf [kp] float (zero past k) and xsum [groups] (each group's sum of x). */
static void load_x(const void *x, int64_t off, int dtype, int k, int64_t kp, int groups, int gs, float *restrict xf,
                   float *restrict xsum) {
    load_row(x, off, dtype, k, xf);
    memset(xf + k, 0, (size_t)(kp - k) * sizeof(float));
    for (int g = 0; g < groups; g++) {
        float sum = 0.0f;
        for (int c = g * gs; c < (g + 1) * gs; c++) sum += xf[c];
        xsum[g] = sum;
    }
}

/* xf [kp] -> xh, xl [kp] (x16 = 256 xh + xl) and dx [groups]. */
static void quantize_x(const float *restrict xf, int groups, int gs, int8_t *restrict xh, int8_t *restrict xl,
                       float *restrict dx) {
    for (int g = 0; g < groups; g++) {
        float amax = 0.0f;
        for (int c = g * gs; c < (g + 1) * gs; c++) amax = fmaxf(amax, fabsf(xf[c]));
        dx[g] = amax / (float)X16_MAX;
        const float inv = dx[g] > 0.0f ? 1.0f / dx[g] : 0.0f;
        for (int c = g * gs; c < (g + 1) * gs; c++) {
            float q = nearbyintf(xf[c] * inv); /* round half to even, as torch.round */
            q = q > X16_MAX ? X16_MAX : q < -X16_MAX ? -X16_MAX : q;
            const int v = (int)q, lo = ((v + 128) & 255) - 128;
            xl[c] = (int8_t)lo;
            xh[c] = (int8_t)((v - lo) / 256);
        }
    }
}

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- AVX-512: one block of 16 weight rows against R rows of x ---------------------------- */
#ifdef HAVE_AVX512
/* Integer path. xh/xl/dx/xsum rows are xs / gstride apart; res [R][16]. NA int32 accumulators
 * per (x row, byte half): two for chunk parity, and with one row of x two more for low/high
 * nibbles, so no chain of dependent vpdpbusd outlasts the loads feeding it. */
#ifdef HAVE_AVX512_VNNI
static inline __attribute__((always_inline)) void block_int_avx512(const uint8_t *restrict w,
                                                                   const float *restrict s, int groups, int cpg,
                                                                   const int8_t *restrict xh,
                                                                   const int8_t *restrict xl, int64_t xs,
                                                                   const float *restrict dx,
                                                                   const float *restrict xsum, int gstride,
                                                                   const int R, float *restrict res) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int NA = R == 1 ? 4 : 2;
    __m512 acc[4], zacc[4];
    for (int r = 0; r < R; r++) acc[r] = zacc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i ah[4][4], al[4][4];
        for (int r = 0; r < R; r++)
            for (int a = 0; a < NA; a++) ah[r][a] = al[r][a] = _mm512_setzero_si512();
        for (int c = g * cpg; c < (g + 1) * cpg; c += 2) {
#pragma GCC unroll 2
            for (int e = 0; e < 2; e++) {
                const __m512i v = _mm512_loadu_si512(w + 64 * (c + e));
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                const int a0 = NA == 4 ? 2 * e : e, a1 = NA == 4 ? 2 * e + 1 : e;
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const int8_t *ph = xh + r * xs + 8 * (c + e), *pl = xl + r * xs + 8 * (c + e);
                    ah[r][a0] = _mm512_dpbusd_epi32(ah[r][a0], lo, _mm512_set1_epi32(load4(ph)));
                    ah[r][a1] = _mm512_dpbusd_epi32(ah[r][a1], hi, _mm512_set1_epi32(load4(ph + 4)));
                    al[r][a0] = _mm512_dpbusd_epi32(al[r][a0], lo, _mm512_set1_epi32(load4(pl)));
                    al[r][a1] = _mm512_dpbusd_epi32(al[r][a1], hi, _mm512_set1_epi32(load4(pl + 4)));
                }
            }
        }
        const __m512 sc = _mm512_loadu_ps(s + 32 * g), mn = _mm512_loadu_ps(s + 32 * g + 16);
        for (int r = 0; r < R; r++) {
            __m512i h = ah[r][0], l = al[r][0];
            for (int a = 1; a < NA; a++) {
                h = _mm512_add_epi32(h, ah[r][a]);
                l = _mm512_add_epi32(l, al[r][a]);
            }
            const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc, _mm512_set1_ps(dx[r * gstride + g])),
                                     acc[r]);
            zacc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r * gstride + g]), zacc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(res + 16 * r, _mm512_add_ps(acc[r], zacc[r]));
}
#endif

/* Float path: xf rows (pre-scaled by column_factor) are xs apart. */
static inline __attribute__((always_inline)) void block_float_avx512(const uint8_t *restrict w,
                                                                     const float *restrict s, int groups, int cpg,
                                                                     const float *restrict xf, int64_t xs,
                                                                     const float *restrict xsum, int gstride,
                                                                     const int R, float *restrict res) {
    const int NA = R == 1 ? 4 : 2;
    __m512 acc[4], zacc[4];
    for (int r = 0; r < R; r++) acc[r] = zacc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 p[4][4];
        for (int r = 0; r < R; r++)
            for (int a = 0; a < NA; a++) p[r][a] = _mm512_setzero_ps();
        for (int c = g * cpg; c < (g + 1) * cpg; c++) {
            const __m512i v = _mm512_loadu_si512(w + 64 * c);
            const __m512i v7 = _mm512_srli_epi32(v, 4);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) { /* column 8c + j: nibble t of each lane */
                const int t = j < 4 ? 2 * j : 2 * (j - 4) + 1;
                const __m512i qi = t == 7 ? _mm512_and_si512(v7, _mm512_set1_epi32(0x0F000000))
                                          : _mm512_and_si512(v, _mm512_set1_epi32(0xF << (4 * t)));
                const __m512 wf = _mm512_cvtepi32_ps(qi);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    p[r][j % NA] = _mm512_fmadd_ps(wf, _mm512_set1_ps(xf[r * xs + 8 * c + j]), p[r][j % NA]);
            }
        }
        const __m512 sc = _mm512_loadu_ps(s + 32 * g), mn = _mm512_loadu_ps(s + 32 * g + 16);
        for (int r = 0; r < R; r++) {
            __m512 sum = p[r][0];
            for (int a = 1; a < NA; a++) sum = _mm512_add_ps(sum, p[r][a]);
            acc[r] = _mm512_fmadd_ps(sum, sc, acc[r]);
            zacc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r * gstride + g]), zacc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(res + 16 * r, _mm512_add_ps(acc[r], zacc[r]));
}
#endif

/* ---- AVX2: the same per half block (8 rows: bytes 32h .. 32h + 31 of each chunk) ------------ */
#ifdef HAVE_AVX2
/* Integer path: vpmaddubsw sums two u8 x s8 products into int16 (at most 2 * 15 * 128 = 3840),
 * four of them (two chunks, low and high nibbles) are added as int16 (<= 15360), then vpmaddwd
 * against ones widens to int32. */
static inline __attribute__((always_inline)) void half_int_avx2(const uint8_t *restrict w, const float *restrict s,
                                                                int groups, int cpg, const int8_t *restrict xh,
                                                                const int8_t *restrict xl, int64_t xs,
                                                                const float *restrict dx, const float *restrict xsum,
                                                                int gstride, const int R, float *restrict res) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[4], zacc[4];
    for (int r = 0; r < R; r++) acc[r] = zacc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i ah[4], al[4];
        for (int r = 0; r < R; r++) ah[r] = al[r] = _mm256_setzero_si256();
        for (int c = g * cpg; c < (g + 1) * cpg; c += 2) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + 64 * (c + 1)));
            const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
            const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *ph = xh + r * xs + 8 * c, *pl = xl + r * xs + 8 * c;
                __m256i th = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_set1_epi32(load4(ph))),
                                              _mm256_maddubs_epi16(hi0, _mm256_set1_epi32(load4(ph + 4))));
                th = _mm256_add_epi16(th, _mm256_add_epi16(_mm256_maddubs_epi16(lo1, _mm256_set1_epi32(load4(ph + 8))),
                                                           _mm256_maddubs_epi16(hi1, _mm256_set1_epi32(load4(ph + 12)))));
                __m256i tl = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_set1_epi32(load4(pl))),
                                              _mm256_maddubs_epi16(hi0, _mm256_set1_epi32(load4(pl + 4))));
                tl = _mm256_add_epi16(tl, _mm256_add_epi16(_mm256_maddubs_epi16(lo1, _mm256_set1_epi32(load4(pl + 8))),
                                                           _mm256_maddubs_epi16(hi1, _mm256_set1_epi32(load4(pl + 12)))));
                ah[r] = _mm256_add_epi32(ah[r], _mm256_madd_epi16(th, ones));
                al[r] = _mm256_add_epi32(al[r], _mm256_madd_epi16(tl, ones));
            }
        }
        const __m256 sc = _mm256_loadu_ps(s + 32 * g), mn = _mm256_loadu_ps(s + 32 * g + 16);
        for (int r = 0; r < R; r++) {
            const __m256i sum = _mm256_add_epi32(_mm256_slli_epi32(ah[r], 8), al[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sc, _mm256_set1_ps(dx[r * gstride + g])),
                                     acc[r]);
            zacc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[r * gstride + g]), zacc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res + 16 * r, _mm256_add_ps(acc[r], zacc[r]));
}

static inline __attribute__((always_inline)) void half_float_avx2(const uint8_t *restrict w,
                                                                  const float *restrict s, int groups, int cpg,
                                                                  const float *restrict xf, int64_t xs,
                                                                  const float *restrict xsum, int gstride,
                                                                  const int R, float *restrict res) {
    const int NA = R == 1 ? 4 : 2;
    __m256 acc[4], zacc[4];
    for (int r = 0; r < R; r++) acc[r] = zacc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256 p[4][4];
        for (int r = 0; r < R; r++)
            for (int a = 0; a < NA; a++) p[r][a] = _mm256_setzero_ps();
        for (int c = g * cpg; c < (g + 1) * cpg; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
            const __m256i v7 = _mm256_srli_epi32(v, 4);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int t = j < 4 ? 2 * j : 2 * (j - 4) + 1;
                const __m256i qi = t == 7 ? _mm256_and_si256(v7, _mm256_set1_epi32(0x0F000000))
                                          : _mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * t)));
                const __m256 wf = _mm256_cvtepi32_ps(qi);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    p[r][j % NA] = _mm256_fmadd_ps(wf, _mm256_set1_ps(xf[r * xs + 8 * c + j]), p[r][j % NA]);
            }
        }
        const __m256 sc = _mm256_loadu_ps(s + 32 * g), mn = _mm256_loadu_ps(s + 32 * g + 16);
        for (int r = 0; r < R; r++) {
            __m256 sum = p[r][0];
            for (int a = 1; a < NA; a++) sum = _mm256_add_ps(sum, p[r][a]);
            acc[r] = _mm256_fmadd_ps(sum, sc, acc[r]);
            zacc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[r * gstride + g]), zacc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res + 16 * r, _mm256_add_ps(acc[r], zacc[r]));
}
#endif

/* ---- portable: one block, one row of x (unscaled xf), exact float32 of the float path ------ */
static void block_scalar(const uint8_t *restrict w, const float *restrict s, int groups, int gs,
                         const float *restrict xf, float *restrict res) {
    for (int r = 0; r < BR; r++) {
        float sum = 0.0f;
        for (int g = 0; g < groups; g++) {
            const float sc = s[32 * g + r], mn = s[32 * g + 16 + r];
            for (int c = g * gs; c < (g + 1) * gs; c++) {
                const int j = c % 8;
                const uint8_t byte = w[64 * (c / 8) + 4 * r + j % 4];
                const int q = j < 4 ? byte & 15 : byte >> 4;
                sum += xf[c] * ((float)q * sc + mn);
            }
        }
        res[r] = sum;
    }
}

/* ---- driver --------------------------------------------------------------------------------- */

/* One block against every row of x, in tiles of 4, 2 and 1 rows. */
static void run_block(const uint8_t *w, const float *s, int groups, int gs, int m, int use_int, const float *xf,
                      const int8_t *xh, const int8_t *xl, int64_t kp, const float *dx, const float *xsum,
                      float *res /* [m][16] */) {
    const int cpg = gs / 8;
    int r = 0;
#if defined(HAVE_AVX512)
#define TILE(R)                                                                                                   \
    for (; r + R <= m; r += R) {                                                                                  \
        if (use_int)                                                                                              \
            INT512(R);                                                                                            \
        else                                                                                                      \
            block_float_avx512(w, s, groups, cpg, xf + r * kp, kp, xsum + r * groups, groups, R, res + 16 * r);   \
    }
#ifdef HAVE_AVX512_VNNI
#define INT512(R) block_int_avx512(w, s, groups, cpg, xh + r * kp, xl + r * kp, kp, dx + r * groups, \
                                   xsum + r * groups, groups, R, res + 16 * r)
#else /* AVX-512 without VNNI: the AVX2 integer code on each half */
#define INT512(R)                                                                                                  \
    do {                                                                                                           \
        float h2[2][64];                                                                                           \
        for (int hf = 0; hf < 2; hf++)                                                                             \
            half_int_avx2(w + 32 * hf, s + 8 * hf, groups, cpg, xh + r * kp, xl + r * kp, kp, dx + r * groups,     \
                          xsum + r * groups, groups, R, h2[hf]);                                                   \
        for (int i = 0; i < R; i++)                                                                                \
            for (int hf = 0; hf < 2; hf++) memcpy(res + 16 * (r + i) + 8 * hf, h2[hf] + 16 * i, 8 * sizeof(float)); \
    } while (0)
#endif
    TILE(4)
    TILE(2)
    TILE(1)
#undef TILE
#undef INT512
#elif defined(HAVE_AVX2)
    float h2[2][64];
#define TILE(R)                                                                                                   \
    for (; r + R <= m; r += R) {                                                                                  \
        for (int hf = 0; hf < 2; hf++) {                                                                          \
            if (use_int)                                                                                          \
                half_int_avx2(w + 32 * hf, s + 8 * hf, groups, cpg, xh + r * kp, xl + r * kp, kp,                 \
                              dx + r * groups, xsum + r * groups, groups, R, h2[hf]);                             \
            else                                                                                                  \
                half_float_avx2(w + 32 * hf, s + 8 * hf, groups, cpg, xf + r * kp, kp, xsum + r * groups, groups, \
                                R, h2[hf]);                                                                       \
        }                                                                                                         \
        for (int i = 0; i < R; i++)                                                                               \
            for (int hf = 0; hf < 2; hf++) memcpy(res + 16 * (r + i) + 8 * hf, h2[hf] + 16 * i, 8 * sizeof(float)); \
    }
    TILE(4)
    TILE(2)
    TILE(1)
#undef TILE
#else
    (void)cpg, (void)use_int, (void)xh, (void)xl, (void)dx, (void)xsum;
    for (; r < m; r++) block_scalar(w, s, groups, gs, xf + r * kp, res + 16 * r);
#endif
}

/* mode: MODE_AUTO (integer path for bf16/fp16 where SIMD exists), MODE_FLOAT; scalar: portable only. */
static int int4_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw, const float *sz,
                       int n, int groups, int gs, void *out, int64_t out_stride, int num_threads, int mode,
                       int scalar) {
    if (bad_args(m, n, k, groups, gs)) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t kp = (int64_t)groups * gs;
#if defined(HAVE_AVX2)
    const int simd = !scalar;
#else
    const int simd = 0;
#endif
    const int use_int = simd && mode == MODE_AUTO && dtype != DT_F32;
    /* xf [m, kp] | xsum [m, groups] | dx [m, groups] | xh, xl [m, kp] */
    const size_t floats = (size_t)m * kp + 2 * (size_t)m * groups;
    char *buf = aligned_alloc(64, (floats * sizeof(float) + 2 * (size_t)m * kp + 63) / 64 * 64);
    if (!buf) return -2;
    float *xf = (float *)buf, *xsum = xf + (size_t)m * kp, *dx = xsum + (size_t)m * groups;
    int8_t *xh = (int8_t *)(dx + (size_t)m * groups), *xl = xh + (size_t)m * kp;
    for (int r = 0; r < m; r++) {
        load_x(x, r * x_stride, dtype, k, kp, groups, gs, xf + r * kp, xsum + r * groups);
        if (use_int)
            quantize_x(xf + r * kp, groups, gs, xh + r * kp, xl + r * kp, dx + r * groups);
        else if (simd)
            for (int64_t c = 0; c < kp; c++) xf[r * kp + c] *= column_factor(c);
    }
    const int blocks = (n + BR - 1) / BR;
    int rc = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && blocks > 1)
    {
        float *res = aligned_alloc(64, (size_t)m * BR * sizeof(float) + 64);
        if (!res) {
#pragma omp atomic write
            rc = -2;
        }
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++) {
            if (!res) continue;
            const uint8_t *w = qw + (int64_t)b * (kp / 8) * 64;
            const float *s = sz + (int64_t)b * groups * 2 * BR;
            if (simd)
                run_block(w, s, groups, gs, m, use_int, xf, xh, xl, kp, dx, xsum, res);
            else
                for (int r = 0; r < m; r++) block_scalar(w, s, groups, gs, xf + r * kp, res + BR * r);
            const int rows = n - b * BR < BR ? n - b * BR : BR;
            for (int r = 0; r < m; r++) store_row(out, r * out_stride + b * BR, dtype, rows, res + BR * r);
        }
        free(res);
    }
    free(buf);
    return rc;
}

/* Returns 0, or a negative code for arguments it cannot take (the caller checks them first). */
int devin_int4_linear(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw, const float *sz,
                      int n, int groups, int group_size, void *out, int64_t out_stride, int num_threads) {
    return int4_linear(x, x_stride, m, k, dtype, qw, sz, n, groups, group_size, out, out_stride, num_threads,
                       MODE_AUTO, 0);
}

/* The float path only, at any dtype and row count (tests and benchmarks compare the two). */
int devin_int4_linear_float(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw,
                            const float *sz, int n, int groups, int group_size, void *out, int64_t out_stride,
                            int num_threads) {
    return int4_linear(x, x_stride, m, k, dtype, qw, sz, n, groups, group_size, out, out_stride, num_threads,
                       MODE_FLOAT, 0);
}

/* The same product by the portable path only (tests check the vector paths against it). */
int devin_int4_linear_scalar(const void *x, int64_t x_stride, int m, int k, int dtype, const uint8_t *qw,
                             const float *sz, int n, int groups, int group_size, void *out, int64_t out_stride) {
    return int4_linear(x, x_stride, m, k, dtype, qw, sz, n, groups, group_size, out, out_stride, 1, MODE_FLOAT, 1);
}

/* Which vector code this build runs: 2 = AVX-512 (VNNI or not), 1 = AVX2, 0 = portable. */
int devin_int4_simd(void) {
#if defined(HAVE_AVX512)
    return 2;
#elif defined(HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}
