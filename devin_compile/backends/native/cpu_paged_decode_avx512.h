/* The AVX-512 task of cpu_paged_decode.c: every KV head of one sequence's chunk of keys, read
 * straight from the pool (no float32 copy of the chunk), for head dims that are multiples of 16.
 *
 * Scores: sixteen keys at a time, every query head of the group against the same sixteen rows
 * (in L1), one 16-lane product per key (q · k over D in FMA steps; bf16 keys and query by
 * vdpbf16ps pair products, exact in float32, the scale applied after), the sixteen products
 * reduced to one vector of sixteen scores by a transpose-and-add tree (no horizontal sum per
 * key). Weighted values: per tile of up to 64 value features and up to four query heads, each
 * value row is loaded (and widened to float32) once and serves every query head of the tile from
 * registers. Arithmetic is float32, as in the portable path; only the summation order differs.
 * Memory: each thread claims its next task before working on the current one and prefetches that
 * task's slot rows (keys and values, every head) into L2 a few rows per block of work, so the
 * reads of the next task overlap this one's arithmetic (a step's K/V come from DRAM: 30 layers of
 * a 64-sequence batch are far larger than the caches).
 *
 * Included by cpu_paged_decode.c (which defines exp_shifted) where HAVE_AVX512 is set; its entry
 * is run_tasks16. */
#ifndef DEVIN_CPU_PAGED_DECODE_AVX512_H
#define DEVIN_CPU_PAGED_DECODE_AVX512_H

/* what a task needs besides its sequence and keys */
typedef struct {
    const void *q;
    int64_t q_row_stride, q_head_stride;
    const int64_t *q_rows;
    const void *k;
    int64_t k_block_stride, k_slot_stride, k_head_stride;
    const void *v;
    int64_t v_block_stride, v_slot_stride, v_head_stride;
    const int32_t *tables;
    int64_t table_stride;
    int num_kv_heads, group, head_dim, v_head_dim, block_size;
    float scale;
} DecodeArgs;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* slot rows to prefetch into L2, a few at a time, while a task computes: whole rows (every KV
 * head) of keys and values; ``done`` rows so far, ``step`` more per call of prefetch_more */
typedef struct {
    const char *k, *v;
    const int64_t *kofs, *vofs; /* element offsets of each key's slot row */
    int k_bytes, v_bytes, esize, w, done, step;
} Prefetch;

/* prefetch keys [j0, j1) of pf (clipped to its w) into L2 */
ALWAYS_INLINE void prefetch_rows(const Prefetch *pf, int j0, int j1) {
    for (int j = j0; j < j1 && j < pf->w; j++) {
        for (int b = 0; b < pf->k_bytes; b += 64) _mm_prefetch(pf->k + pf->kofs[j] * pf->esize + b, _MM_HINT_T1);
        for (int b = 0; b < pf->v_bytes; b += 64) _mm_prefetch(pf->v + pf->vofs[j] * pf->esize + b, _MM_HINT_T1);
    }
}

ALWAYS_INLINE void prefetch_more(Prefetch *pf) {
    if (!pf || pf->done >= pf->w) return;
    prefetch_rows(pf, pf->done, pf->done + pf->step);
    pf->done += pf->step;
}

/* lane i of the result: the sum of t[i]'s sixteen lanes */
ALWAYS_INLINE __m512 sum_each16(const __m512 *t) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++) /* per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3] of t[2i], t[2i+1] */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit block: the block sums of t[4i .. 4i+3] */
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* block i of the result: the four blocks of y[i] added */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The scores of G query heads against w keys, sixteen keys at a time (the sixteen rows stay in
 * L1 while every query head reads them): s[g][j] = q_g · key j, key j's row at cache + off[j].
 * Query head g at q + g * q_stride: float32 and pre-scaled (dot16), or bf16 and unscaled with
 * scale applied to the sums (dot16_bf16). Each block of keys moves the prefetch pf (if any) on. */
#define SCORES_BLOCKS(DOT, SCALE)                                                                           \
    for (int j = 0; j < w; j += 16) {                                                                       \
        const int m = w - j < 16 ? w - j : 16;                                                              \
        prefetch_more(pf);                                                                                  \
        for (int g = 0; g < G; g++) {                                                                       \
            __m512 t[16];                                                                                   \
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) t[i] =                                    \
                i < m ? DOT(q + (int64_t)g * q_stride, cache, off[j + i], D, dt) : _mm512_setzero_ps();     \
            _mm512_mask_storeu_ps(s + (int64_t)g * w + j, (__mmask16)((1u << m) - 1u), SCALE(sum_each16(t)));  \
        }                                                                                                   \
    }

/* lanes of q · row (D a multiple of 16; q float32, the row of dtype dt) */
ALWAYS_INLINE __m512 dot16(const float *q, const void *cache, int64_t off, int D, int dt) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(cache, off + d, dt), acc);
    return acc;
}

#define AS_IS(x) (x)
ALWAYS_INLINE void scores16(const float *restrict q, int64_t q_stride, int G, const void *cache,
                            const int64_t *restrict off, int w, int D, int dt, float *restrict s, Prefetch *pf) {
    SCORES_BLOCKS(dot16, AS_IS)
}

#ifdef __AVX512BF16__
/* lanes of q · row for bf16 q and row (D a multiple of 32): pair products summed in float32 (vdpbf16ps) */
ALWAYS_INLINE __m512 dot16_bf16(const uint16_t *q, const void *cache, int64_t off, int D, int dt) {
    (void)dt;
    const uint16_t *row = (const uint16_t *)cache + off;
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(row + d));
    return acc;
}

#define TIMES_SCALE(x) _mm512_mul_ps((x), vscale)
ALWAYS_INLINE void scores16_bf16(const uint16_t *restrict q, int64_t q_stride, int G, float scale, const void *cache,
                                 const int64_t *restrict off, int w, int D, float *restrict s, Prefetch *pf) {
    const int dt = DT_BF16;
    const __m512 vscale = _mm512_set1_ps(scale);
    SCORES_BLOCKS(dot16_bf16, TIMES_SCALE)
}
#endif

/* the largest of s[0 .. w-1] (w >= 1) */
ALWAYS_INLINE float max16(const float *s, int w) {
    const __m512 lowest = _mm512_set1_ps(-INFINITY);
    __m512 m = lowest;
    int j = 0;
    for (; j + 16 <= w; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (j < w) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(lowest, (__mmask16)((1u << (w - j)) - 1u), s + j));
    return _mm512_reduce_max_ps(m);
}

/* acc[g][16*NV] (row stride DV) = sum_j s[g][j] * value j's 16*NV features from d0, for NG query
 * heads: each value row is loaded once for all NG heads, the NG*NV sums stay in registers */
ALWAYS_INLINE void weighted_tile(const float *restrict s, int w, const void *cache, const int64_t *restrict off,
                                 int d0, int DV, int dt, float *restrict acc, const int NG, const int NV) {
    __m512 a[4][4];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NV; c++) a[g][c] = _mm512_setzero_ps();
    for (int j = 0; j < w; j++) {
        __m512 v[4];
        for (int c = 0; c < NV; c++) v[c] = load16(cache, off[j] + d0 + 16 * c, dt);
        for (int g = 0; g < NG; g++) {
            const __m512 p = _mm512_set1_ps(s[(int64_t)g * w + j]);
            for (int c = 0; c < NV; c++) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc + (int64_t)g * DV + d0 + 16 * c, a[g][c]);
}

/* acc[g][DV] = sum_j s[g][j] * value j, for the G query heads of one KV head (value j's row at
 * cache + off[j]; DV a multiple of 16): tiles of up to 4 heads by 64 features (else 16) */
ALWAYS_INLINE void weighted16(const float *restrict s, int w, int G, const void *cache, const int64_t *restrict off,
                              int DV, int dt, float *restrict acc) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int ng = G - g0 < 4 ? G - g0 : 4;
        const float *sg = s + (int64_t)g0 * w;
        float *ag = acc + (int64_t)g0 * DV;
        for (int d0 = 0; d0 < DV;) {
            const int nv = DV - d0 >= 64 ? 4 : 1;
            switch (ng * 4 + nv) {
            case 8: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 1, 4); break;
            case 12: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 2, 4); break;
            case 16: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 3, 4); break;
            case 20: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 4, 4); break;
            case 5: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 1, 1); break;
            case 9: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 2, 1); break;
            case 13: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 3, 1); break;
            default: weighted_tile(sg, w, cache, off, d0, DV, dt, ag, 4, 1); break;
            }
            d0 += 16 * nv;
        }
    }
}

/* kofs/vofs[j]: the element offset of the slot row (head 0) of key j0 + j of sequence b, j < w */
static inline void task_rows(const DecodeArgs *a, int b, int j0, int w, int64_t *restrict kofs,
                             int64_t *restrict vofs) {
    const int32_t *table = a->tables + (int64_t)b * a->table_stride;
    for (int j = 0; j < w;) { /* block by block: one division per block */
        const int blk = table[(j0 + j) / a->block_size];
        const int64_t kb = (int64_t)blk * a->k_block_stride, vb = (int64_t)blk * a->v_block_stride;
        for (int o = (j0 + j) % a->block_size; o < a->block_size && j < w; o++, j++) {
            kofs[j] = kb + (int64_t)o * a->k_slot_stride;
            vofs[j] = vb + (int64_t)o * a->v_slot_stride;
        }
    }
}

/* A Prefetch of the whole slot rows at kofs/vofs (w keys), ``step`` rows per call */
static inline Prefetch slot_rows(const DecodeArgs *a, int dt, const int64_t *kofs, const int64_t *vofs, int w,
                                 int step) {
    const int esize = dt == DT_F32 ? 4 : 2, last = a->num_kv_heads - 1;
    const Prefetch pf = {(const char *)a->k, (const char *)a->v, kofs, vofs,
                         (int)((last * a->k_head_stride + a->head_dim) * esize),
                         (int)((last * a->v_head_stride + a->v_head_dim) * esize), esize, w, 0, step > 0 ? step : 1};
    return pf;
}

/* One task: w keys of sequence b (slot rows at kofs/vofs, from task_rows; both are moved on by
 * one head per head). partial + h * part_stride receives m[G], l[G], acc[G][Dv] of KV head h; with
 * probs, [G][chunk] per head at probs + h * probs_stride gets exp(score - m). Scratch: qf [G][D],
 * s [G][w]. Prefetching: own (the task's first head pass, when nothing fetched its rows before)
 * and next (the rows of the task this thread takes next, spread over this task's work). */
ALWAYS_INLINE void attend_task16(const DecodeArgs *a, int b, int w, int dt, int64_t *restrict kofs,
                                 int64_t *restrict vofs, float *restrict qf, float *restrict s, float *partial,
                                 int64_t part_stride, float *probs, int64_t probs_stride, Prefetch *own,
                                 Prefetch *next) {
    const int G = a->group, D = a->head_dim, DV = a->v_head_dim;
    for (int h = 0; h < a->num_kv_heads; h++) {
        Prefetch *pf = h == 0 && own ? own : next;
        float *pp = partial + h * part_stride;
        const int64_t q_off = a->q_rows[b] * a->q_row_stride + (int64_t)h * G * a->q_head_stride;
#ifdef __AVX512BF16__
        if (dt == DT_BF16 && D % 32 == 0) {
            scores16_bf16((const uint16_t *)a->q + q_off, a->q_head_stride, G, a->scale, a->k, kofs, w, D, s, pf);
        } else
#endif
        {
            for (int g = 0; g < G; g++) {
                load_row(a->q, q_off + g * a->q_head_stride, dt, D, qf + (int64_t)g * D);
                for (int d = 0; d < D; d++) qf[(int64_t)g * D + d] *= a->scale;
            }
            scores16(qf, D, G, a->k, kofs, w, D, dt, s, pf);
        }
        for (int g = 0; g < G; g++) {
            float *sg = s + (int64_t)g * w;
            const float mx = max16(sg, w);
            pp[g] = mx;
            pp[G + g] = exp_shifted(sg, w, mx);
        }
        weighted16(s, w, G, a->v, vofs, DV, dt, pp + 2 * G);
        if (probs) memcpy(probs + h * probs_stride, s, sizeof(float) * (size_t)G * (size_t)w);
        for (int j = 0; j < w; j++) { /* the next head: the same slots, one head further */
            kofs[j] += a->k_head_stride;
            vofs[j] += a->v_head_stride;
        }
    }
}

/* attend_task16 specialised per dtype (its loads are inlined with dt a constant) */
static void attend_task16_any(const DecodeArgs *a, int b, int w, int dt, int64_t *kofs, int64_t *vofs, float *qf,
                              float *s, float *partial, int64_t part_stride, float *probs, int64_t probs_stride,
                              Prefetch *own, Prefetch *next) {
    if (dt == DT_BF16)
        attend_task16(a, b, w, DT_BF16, kofs, vofs, qf, s, partial, part_stride, probs, probs_stride, own, next);
    else if (dt == DT_F16)
        attend_task16(a, b, w, DT_F16, kofs, vofs, qf, s, partial, part_stride, probs, probs_stride, own, next);
    else
        attend_task16(a, b, w, DT_F32, kofs, vofs, qf, s, partial, part_stride, probs, probs_stride, own, next);
}

/* The tasks on every thread: each thread claims its next task before working on the current one
 * and prefetches that task's rows while it works (dynamic scheduling with one task of lookahead). */
static int run_tasks16(const DecodeArgs *a, int dt, const int64_t *first, const int32_t *task_seq,
                       const int32_t *lens, int64_t nchunks, int chunk, float *partial, int64_t part, float *probs,
                       int num_threads) {
    int failed = 0;
    int64_t counter = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t *ofs = (int64_t *)malloc(sizeof(int64_t) * 4 * (size_t)chunk); /* this task's, the next's */
        float *s = (float *)malloc(sizeof(float) * (size_t)chunk * (size_t)a->group);
        float *qf = (float *)malloc(sizeof(float) * (size_t)a->group * (size_t)a->head_dim);
        int64_t c, nc;
#pragma omp atomic capture
        c = counter++;
        if (!ofs || !s || !qf) {
#pragma omp atomic write
            failed = 1;
            c = nchunks;
        }
        int b = 0, w = 0, prefetched = 0, cur = 0;
        if (c < nchunks) {
            b = task_seq[c];
            const int j0 = (int)(c - first[b]) * chunk;
            w = (j0 + chunk < lens[b] ? j0 + chunk : lens[b]) - j0;
            task_rows(a, b, j0, w, ofs, ofs + chunk);
        }
        while (c < nchunks) {
#pragma omp atomic capture
            nc = counter++;
            int64_t *mine = ofs + 2 * cur * chunk, *theirs = ofs + 2 * (1 - cur) * chunk;
            int nb = 0, nw = 0;
            if (nc < nchunks) {
                nb = task_seq[nc];
                const int j0 = (int)(nc - first[nb]) * chunk;
                nw = (j0 + chunk < lens[nb] ? j0 + chunk : lens[nb]) - j0;
                task_rows(a, nb, j0, nw, theirs, theirs + chunk);
            }
            Prefetch own = slot_rows(a, dt, mine, mine + chunk, w, 16), next;
            next = slot_rows(a, dt, theirs, theirs + chunk, nw, (nw + 1) / (a->num_kv_heads * ((w + 15) / 16)) + 1);
            if (!prefetched) { /* the first task: its first rows now, the rest one block ahead */
                prefetch_rows(&own, 0, 16);
                own.done = 16;
            }
            attend_task16_any(a, b, w, dt, mine, mine + chunk, qf, s, partial + c * a->num_kv_heads * part, part,
                              probs ? probs + c * a->num_kv_heads * a->group * chunk : NULL,
                              (int64_t)a->group * chunk, prefetched ? NULL : &own, nc < nchunks ? &next : NULL);
            c = nc, b = nb, w = nw, cur = 1 - cur, prefetched = 1;
        }
        free(ofs);
        free(s);
        free(qf);
    }
    return failed;
}

#endif
