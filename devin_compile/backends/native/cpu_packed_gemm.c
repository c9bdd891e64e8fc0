// Float32 GEMMs over weights packed in blocks of 16 output columns, for the few rows of a decode
// step: devin::moe_experts' two phases and devin::packed_gemm_linear. Layouts:
//
//   dense   [N/16][K][16]:    for output block j, row k holds columns 16j..16j+15 (a [N, K] weight);
//   gate_up [E][F/16][H][32]: for block j, row k holds gate columns 16j..16j+15 then the same up
//                             columns (HF's gate_up_proj [E, 2F, H], re-laid out);
//   down    [E][H/16][F][16]: the dense layout per expert (HF's down_proj [E, H, F]).
//
// A task is (expert, output block): it streams that block of the weights once (64 KB for Mixtral's
// gate/up at H 512) and applies it to all of the task's rows, MR rows at a time, with MR·16
// accumulators in registers; so a decode step reads each weight (each selected expert's) once.
// Tasks are split over OpenMP threads (torch's libgomp). Vectors are GCC vector extensions of 16
// floats: one zmm with AVX-512, two ymm with AVX2; FMAs come from contraction (-O3 -march=native).
//
// devin_moe_gate_up:   buf[p] = [x[tok[p]] @ gate_eᵀ | x[tok[p]] @ up_eᵀ] (row p: 2F floats), pairs
//                      sorted by expert (offs[e]..offs[e+1] are expert e's);
// devin_moe_down:      y[pair[p]] = (h[p] @ down_eᵀ) * pair_w[pair[p]] (row: H floats);
// devin_packed_gemm_linear: y[r] = x[r] @ Wᵀ (dense layout);
// devin_packed_gemm_linear_bf16: the same for bf16 x and weights in the bf16 pair layout
//                      [N/16][K/2][16][2] (row k2 holds columns 16j..16j+15 of k = 2k2 and 2k2 + 1, as
//                      AVX512-BF16's vdpbf16ps pairs them), float32 y; products exact, float32 sums.
//                      With AMX (built with it, granted by the kernel, K a multiple of 32) whole tiles of 16
//                      rows go through AMX's tdpbf16ps (the pair layout is its B tile), the rest as above.
// Each returns 0, 1 for shapes the packing does not cover (a dimension not a multiple of 16), or 2
// where the build has no AVX512-BF16 (devin_packed_gemm_bf16_built() says which).
#define _GNU_SOURCE /* syscall() from <unistd.h> under -std=c11 (AMX's permission request) */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

#ifdef __AVX512F__
#define MR 8  // 2·MR accumulators + 2 weight vectors in 32 zmm registers
#else
#define MR 2  // AVX2: a v16 is two of 16 ymm registers
#endif

#define INLINE static inline __attribute__((always_inline))

INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

// R rows (a compile-time constant after inlining) of one gate/up block: 2·R accumulator chains.
INLINE void gate_up_tile(const int R, const float *x, int64_t x_stride, const int64_t *tok, const float *w, int h,
                         float *buf, int64_t p0, int f, int j) {
    const float *xr[MR];
    v16 ag[MR], au[MR];
    for (int r = 0; r < R; r++) {
        xr[r] = x + tok[p0 + r] * x_stride;
        ag[r] = (v16){0};
        au[r] = (v16){0};
    }
    for (int k = 0; k < h; k++) {
        const v16 wg = load16(w + 32 * (int64_t)k), wu = load16(w + 32 * (int64_t)k + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const float s = xr[r][k];
            ag[r] += s * wg;
            au[r] += s * wu;
        }
    }
    for (int r = 0; r < R; r++) {
        float *o = buf + (p0 + r) * 2 * (int64_t)f;
        store16(o + 16 * j, ag[r]);
        store16(o + f + 16 * j, au[r]);
    }
}

// R rows of one 16-column block of a dense-layout weight: yr[r][16j..] = Σ_k xr[r][k]·w[k] (times
// scale[r] when given). k runs in pairs over two accumulator sets (one chain per row is
// latency-bound at one row), added at the end.
INLINE void block_tile(const int R, const float *const *xr, const float *w, int k_len, float *const *yr,
                       const float *scale, int j) {
    v16 a0[MR], a1[MR];
    for (int r = 0; r < R; r++) {
        a0[r] = (v16){0};
        a1[r] = (v16){0};
    }
    for (int k = 0; k < k_len; k += 2) {
        const v16 w0 = load16(w + 16 * (int64_t)k), w1 = load16(w + 16 * (int64_t)k + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            a0[r] += xr[r][k] * w0;
            a1[r] += xr[r][k + 1] * w1;
        }
    }
    for (int r = 0; r < R; r++) store16(yr[r] + 16 * j, scale ? (a0[r] + a1[r]) * scale[r] : a0[r] + a1[r]);
}

// Expert rows p0.. of the down phase: gather row pointers and routing weights, then the tile.
INLINE void down_tile(const int R, const float *hbuf, const int64_t *pair, const float *pair_w, const float *w, int f,
                      float *y, int h, int64_t p0, int j) {
    const float *xr[MR];
    float *yr[MR], scale[MR];
    for (int r = 0; r < R; r++) {
        xr[r] = hbuf + (p0 + r) * (int64_t)f;
        yr[r] = y + pair[p0 + r] * (int64_t)h;
        scale[r] = pair_w[pair[p0 + r]];
    }
    block_tile(R, xr, w, f, yr, scale, j);
}

// Rows r0.. of a dense linear.
INLINE void linear_tile(const int R, const float *x, int64_t x_stride, const float *w, int k, float *y,
                        int64_t y_stride, int64_t r0, int j) {
    const float *xr[MR];
    float *yr[MR];
    for (int r = 0; r < R; r++) {
        xr[r] = x + (r0 + r) * x_stride;
        yr[r] = y + (r0 + r) * y_stride;
    }
    block_tile(R, xr, w, k, yr, 0, j);
}

#define ROWS(c) ((c) < MR ? (c) : MR)
#define DISPATCH(TILE, n, ...)                        \
    switch (n) {                                      \
        case 1: TILE(ROWS(1), __VA_ARGS__); break;    \
        case 2: TILE(ROWS(2), __VA_ARGS__); break;    \
        case 3: TILE(ROWS(3), __VA_ARGS__); break;    \
        case 4: TILE(ROWS(4), __VA_ARGS__); break;    \
        case 5: TILE(ROWS(5), __VA_ARGS__); break;    \
        case 6: TILE(ROWS(6), __VA_ARGS__); break;    \
        case 7: TILE(ROWS(7), __VA_ARGS__); break;    \
        default: TILE(MR, __VA_ARGS__); break;        \
    }

// The experts that own rows, in order; returns how many.
static int active_experts(const int64_t *offs, int e, int *act) {
    int n = 0;
    for (int i = 0; i < e; i++)
        if (offs[i + 1] > offs[i]) act[n++] = i;
    return n;
}

int devin_moe_gate_up(const float *x, int64_t x_stride, const int64_t *tok, const int64_t *offs, int e,
                      const float *w, int h, int f, float *buf, int num_threads) {
    if (f <= 0 || h <= 0 || f % 16 || h % 16) return 1;
    const int fb = f / 16;
    int act[e > 0 ? e : 1];
    const int64_t tasks = (int64_t)active_experts(offs, e, act) * fb;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int ex = act[t / fb], j = (int)(t % fb);
        const float *wp = w + ((int64_t)ex * fb + j) * h * 32;
        for (int64_t p = offs[ex]; p < offs[ex + 1]; p += MR) {
            const int64_t n = offs[ex + 1] - p;
            DISPATCH(gate_up_tile, n, x, x_stride, tok, wp, h, buf, p, f, j)
        }
    }
    return 0;
}

int devin_moe_down(const float *hbuf, const int64_t *pair, const float *pair_w, const int64_t *offs, int e,
                   const float *w, int h, int f, float *y, int num_threads) {
    if (f <= 0 || h <= 0 || f % 16 || h % 16) return 1;
    const int hb = h / 16;
    int act[e > 0 ? e : 1];
    const int64_t tasks = (int64_t)active_experts(offs, e, act) * hb;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int ex = act[t / hb], j = (int)(t % hb);
        const float *wp = w + ((int64_t)ex * hb + j) * f * 16;
        for (int64_t p = offs[ex]; p < offs[ex + 1]; p += MR) {
            const int64_t n = offs[ex + 1] - p;
            DISPATCH(down_tile, n, hbuf, pair, pair_w, wp, f, y, h, p, j)
        }
    }
    return 0;
}

int devin_packed_gemm_linear(const float *x, int64_t x_stride, int64_t m, const float *w, int n, int k, float *y,
                        int64_t y_stride, int num_threads) {
    if (n <= 0 || k <= 0 || n % 16 || k % 2) return 1;
    const int nb = n / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && nb > 1)
    for (int j = 0; j < nb; j++) {
        const float *wp = w + (int64_t)j * k * 16;
        for (int64_t r = 0; r < m; r += MR) {
            const int64_t left = m - r;
            DISPATCH(linear_tile, left, x, x_stride, wp, k, y, y_stride, r, j)
        }
    }
    return 0;
}

#ifdef __AVX512BF16__
#include <immintrin.h>

// R rows (R <= MR) of one 16-column block over bf16 pairs: acc[r] += (x[r][2k2], x[r][2k2+1]) · w pair; at
// one or two rows four accumulator chains a row (vdpbf16ps's latency would bound one chain).
INLINE void bf16_tile(const int R, const uint16_t *x, int64_t x_stride, const uint16_t *w, int k, float *y,
                      int64_t y_stride, int64_t r0, int j) {
    const int NA = R <= 2 ? 4 : 1, k2n = k / 2;
    __m512 acc[4 * MR];
    for (int i = 0; i < NA * R; i++) acc[i] = _mm512_setzero_ps();
    const uint32_t *xr[MR];
    for (int r = 0; r < R; r++) xr[r] = (const uint32_t *)(x + (r0 + r) * x_stride);
    int k2 = 0;
    for (; k2 + NA <= k2n; k2 += NA)
        for (int a = 0; a < NA; a++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + 32 * (int64_t)(k2 + a));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[r * NA + a] = _mm512_dpbf16_ps(acc[r * NA + a], (__m512bh)_mm512_set1_epi32((int)xr[r][k2 + a]), wv);
        }
    for (; k2 < k2n; k2++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + 32 * (int64_t)k2);
        for (int r = 0; r < R; r++)
            acc[r * NA] = _mm512_dpbf16_ps(acc[r * NA], (__m512bh)_mm512_set1_epi32((int)xr[r][k2]), wv);
    }
    for (int r = 0; r < R; r++) {
        __m512 s = acc[r * NA];
        for (int a = 1; a < NA; a++) s = _mm512_add_ps(s, acc[r * NA + a]);
        _mm512_storeu_ps(y + (r0 + r) * y_stride + 16 * j, s);
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16           // rows of x an AMX tile takes (its A and C tiles have 16 rows)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Whether this process may use AMX tiles (Linux grants the tile state on request; oneDNN asks the same way).
static int amx_ready(void) {
    static int ready = -1;  // asked once; a race only asks twice
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

// Tiles 0 (C: 16 rows x 16 float32), 1 (A: 16 rows of x, 32 bf16), 2 (B: 16 pair rows of a block, 64 bytes).
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 3; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

// Rows r0..r0+15 of x against one 16-column block: the pair layout's 16 rows k2..k2+15 are exactly AMX's
// B tile (VNNI: each row the pairs of 16 columns), 32 bf16 of each row of x its A tile. k % 32 == 0.
static void amx_tile(const uint16_t *x, int64_t x_stride, const uint16_t *w, int k, float *y, int64_t y_stride,
                     int64_t r0, int j) {
    _tile_zero(0);
    for (int kk = 0; kk < k; kk += 32) {
        _tile_loadd(1, x + r0 * x_stride + kk, x_stride * 2);
        _tile_loadd(2, w + 16 * (int64_t)kk, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, y + r0 * y_stride + 16 * j, y_stride * 4);
}
#endif

int devin_packed_gemm_bf16_built(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

int devin_packed_gemm_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *w, int n, int k,
                                  float *y, int64_t y_stride, int num_threads) {
#ifdef __AVX512BF16__
    if (n <= 0 || k <= 0 || n % 16 || k % 2) return 1;
    const int nb = n / 16;
    int64_t amx_rows = 0;  // the first rows, in whole tiles of AMX_ROWS, go through AMX where it is usable
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (m >= AMX_ROWS && k % 32 == 0 && amx_ready()) amx_rows = m / AMX_ROWS * AMX_ROWS;
#endif
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && nb > 1)
    {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx_rows) amx_configure();  // tile configuration is per thread
#endif
#pragma omp for schedule(static)
        for (int j = 0; j < nb; j++) {
            const uint16_t *wp = w + (int64_t)j * k * 16;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            for (int64_t r = 0; r < amx_rows; r += AMX_ROWS) amx_tile(x, x_stride, wp, k, y, y_stride, r, j);
#endif
            for (int64_t r = amx_rows; r < m; r += MR) {
                const int64_t left = m - r;
                DISPATCH(bf16_tile, left, x, x_stride, wp, k, y, y_stride, r, j)
            }
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx_rows) _tile_release();
#endif
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)w, (void)n, (void)k, (void)y, (void)y_stride, (void)num_threads;
    return 2;
#endif
}
