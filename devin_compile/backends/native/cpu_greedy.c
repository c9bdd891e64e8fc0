/* Greedy sampling's reductions over a step's logits, in one pass per row: the first index of each
 * row's maximum (torch.argmax's choice) and whether every value of the row is finite (NaN and ±inf:
 * the sampler fails such a row's request alone). The torch path takes a float32 copy and three
 * reductions (64 rows of a 49k vocabulary: ~1.9 ms on 2 cores).
 *
 * Built and loaded by runtime/greedy_rows.py (system C compiler, -O3 -march=native, OpenMP). Rows are
 * float32 or bf16 (compared as the float32 values they are, so exactly), contiguous in the last dim.
 * With AVX-512, sixteen lanes keep each lane's first maximum and its index; the lanes are then
 * reduced to the greatest value and, among lanes holding it, the smallest index. */
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define SERIAL_ELEMENTS (1 << 16) /* below this a step's rows are reduced on the calling thread */

static inline float value(const void *row, int dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* from element `from` on: updates *best / *at (strictly greater only, so the first maximum stays);
 * returns 0 if a value is NaN or infinite */
static int scan_tail(const void *row, int dt, int64_t from, int64_t V, float *best, int64_t *at) {
    int finite = 1;
    for (int64_t i = from; i < V; i++) {
        const float x = value(row, dt, i);
        finite &= (x - x == 0.0f); /* NaN for NaN and ±inf */
        if (x > *best) {
            *best = x;
            *at = i;
        }
    }
    return finite;
}

#ifdef HAVE_AVX512
static inline __mmask16 not_finite(__m512 x) { /* exponent all ones: NaN or ±inf */
    const __m512i e = _mm512_set1_epi32(0x7f800000);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), e), e);
}

/* the row's first maximum and finiteness, sixteen lanes at a time (V >= 16) */
static int scan16(const void *row, int dt, int64_t V, int64_t *at) {
    __m512 best = load16(row, 0, dt);
    __mmask16 bad = not_finite(best);
    __m512i idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), cur = idx;
    const __m512i step = _mm512_set1_epi32(16);
    int64_t i = 16;
    for (; i + 16 <= V; i += 16) {
        const __m512 x = load16(row, i, dt);
        cur = _mm512_add_epi32(cur, step);
        const __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, x);
        idx = _mm512_mask_mov_epi32(idx, gt, cur);
        bad |= not_finite(x);
    }
    /* NaN lanes never win a comparison; a row with one is reported not finite, its index unused */
    float top = _mm512_reduce_max_ps(best);
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    int64_t first = holders ? _mm512_mask_reduce_min_epi32(holders, idx) : 0;
    const int finite = scan_tail(row, dt, i, V, &top, &first);
    *at = first;
    return finite && !bad;
}
#endif

/* One row: its first maximum's index into *at; returns whether every value is finite. */
static int scan_row(const void *row, int dt, int64_t V, int64_t *at) {
#ifdef HAVE_AVX512
    if (V >= 16) return scan16(row, dt, V, at);
#endif
    float best = value(row, dt, 0);
    *at = 0;
    return scan_tail(row, dt, 0, V, &best, at);
}

/* logits [n, V] (row stride in elements; dtype DT_F32 or DT_BF16) → argmax[n] (int64), finite[n] (0/1).
 * Returns 0, or -1 for arguments it does not take. */
int devin_greedy_rows(const void *logits, int64_t row_stride, int n, int64_t V, int dtype, int64_t *argmax,
                      uint8_t *finite, int num_threads) {
    if (n < 0 || V < 1 || V > INT32_MAX || (dtype != DT_F32 && dtype != DT_BF16)) return -1;
    const int64_t esize = dtype == DT_BF16 ? 2 : 4;
    if ((int64_t)n * V < SERIAL_ELEMENTS) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < n; r++)
        finite[r] = (uint8_t)scan_row((const char *)logits + (int64_t)r * row_stride * esize, dtype, V, argmax + r);
    return 0;
}
