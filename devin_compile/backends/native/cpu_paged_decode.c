/* Paged decode attention for CPU: one query per sequence, K/V read straight from the pool.
 *
 * Built and loaded by cpu_paged_decode.py (system C compiler, -O3 -march=native, OpenMP;
 * no torch headers, so it compiles in about a second). The torch reference in
 * torch_reference.py is the oracle; tests compare against it.
 *
 * Layout (strides in elements):
 *   q    [rows, Hq, D]           row q_rows[b] holds sequence b's query; head h*G+g reads KV head h
 *   pool [blocks, block_size, Hkv, D] for K and for V (their own strides)
 *   tables [n, table_stride] int32  physical block of each logical block of sequence b
 *   lens [n] int32                  cached keys of b (0: the output row is zeros)
 *   out  [rows, Hq, Dv]             written at the same rows as q, in q's dtype
 *
 * Work is split into tasks of (sequence, chunk of `chunk` keys), so one long sequence
 * still fills every thread (split-K, as flash-decoding does). A task serves all G query heads
 * of a KV head from each key and value row it reads (grouped-query attention without repeats)
 * and keeps a numerically stable partial softmax (max, sum, weighted values) per KV head; a
 * second parallel loop merges a sequence's chunks by their log-sum-exp. All arithmetic is float32.
 * Two task bodies: with AVX-512 and head dims in whole 16-lane vectors, cpu_paged_decode_avx512.h
 * reads the rows in place (16 keys' scores per reduction, bf16 keys by pair products, the next
 * keys' rows prefetched); otherwise the portable task below copies the chunk's whole slot rows
 * (every KV head: contiguous in the pool) to float32 once and works from that copy.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cpu_kernels.h"

#define MAX_GROUP 32
#define MAX_DIM 512
#define MAX_CHUNK 4096
#define SERIAL_WORK (1 << 17) /* multiply-adds of a step below which one thread does it all */
#define PASSIVE_SERIAL_WORK (1 << 22) /* ... when OMP_WAIT_POLICY=passive (see serial_work) */

/* The work below which a step runs on the calling thread. Under OMP_WAIT_POLICY=passive the team's
 * threads sleep between parallel regions and each region wakes them: SmolLM2 at batch 1 on a 2-core
 * Intel Xeon, 1 vs 2 threads, passive: 32 vs 144 us at 256 keys, 227 vs 307 at 2048, 333 vs 353 at
 * 3072 (two threads ahead only from ~4k keys); with the default policy two threads win from 256 keys
 * (26 vs 35 us). 2^22 multiply-adds is ~3.6k keys of SmolLM2. */
static int64_t serial_work(void) {
    static int64_t work = -1; /* read once; a race only writes the same value */
    if (work < 0) {
        const char *policy = getenv("OMP_WAIT_POLICY");
        work = policy && strcasecmp(policy, "passive") == 0 ? PASSIVE_SERIAL_WORK : SERIAL_WORK;
    }
    return work;
}

/* exp(x) for x <= 0, written so the loop around it vectorises: x = k*ln2 + r with
 * |r| <= ln2/2, e^r by its Taylor series to r^6 (relative error < 2e-7), 2^k by the exponent. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return p * two_k;
}

/* Gather keys j0..j1-1 of one sequence, every KV head, into dst [w][nheads][dim] float32, block
 * by block: a task reads whole slot rows (all heads), so its reads are contiguous in the pool. */
static inline void gather_rows(const void *cache, int64_t block_stride, int64_t slot_stride, int64_t head_stride,
                               int nheads, const int32_t *table, int block_size, int j0, int j1, int dtype, int dim,
                               float *restrict dst) {
    int j = j0;
    while (j < j1) {
        const int off = j % block_size;
        const int stop = j - off + block_size < j1 ? j - off + block_size : j1;
        const int64_t base = (int64_t)table[j / block_size] * block_stride;
        for (int k = off; k < off + (stop - j); k++)
            for (int h = 0; h < nheads; h++, dst += dim)
                load_row(cache, base + k * slot_stride + h * head_stride, dtype, dim, dst);
        j = stop;
    }
}


/* s[j] = q · k_j for w keys (key j at kbuf + j * ks, float32). */
static inline void scores(const float *restrict qg, const float *restrict kbuf, int w, int D, int64_t ks,
                          float *restrict s) {
    int j = 0;
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        for (; j + 4 <= w; j += 4) { /* four independent FMA chains, not one */
            const float *k0 = kbuf + (int64_t)j * ks;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + ks + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * ks + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * ks + d), a3);
            }
            s[j] = hsum8(a0);
            s[j + 1] = hsum8(a1);
            s[j + 2] = hsum8(a2);
            s[j + 3] = hsum8(a3);
        }
    }
#endif
    for (; j < w; j++) {
        const float *k0 = kbuf + (int64_t)j * ks;
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int d = 0; d < D; d++) a += qg[d] * k0[d];
        s[j] = a;
    }
}

/* acc[DV] = sum_j p[j] * v_j for w values (value j at vbuf + j * vs, float32). */
static inline void weighted_sum(const float *restrict p, const float *restrict vbuf, int w, int DV, int64_t vs,
                                float *restrict acc) {
#ifdef HAVE_AVX2
    if (DV % 32 == 0) {
        for (int d0 = 0; d0 < DV; d0 += 32) { /* 4 accumulators stay in registers over all keys */
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < w; j++) {
                const __m256 pj = _mm256_set1_ps(p[j]);
                const float *v = vbuf + (int64_t)j * vs + d0;
                a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(acc + d0, a0);
            _mm256_storeu_ps(acc + d0 + 8, a1);
            _mm256_storeu_ps(acc + d0 + 16, a2);
            _mm256_storeu_ps(acc + d0 + 24, a3);
        }
        return;
    }
#endif
    for (int d = 0; d < DV; d++) acc[d] = 0.0f;
    for (int j = 0; j < w; j++) {
        const float pj = p[j];
        const float *v = vbuf + (int64_t)j * vs;
#pragma omp simd
        for (int d = 0; d < DV; d++) acc[d] += pj * v[d];
    }
}

/* s[j] = exp(s[j] - mx) (all arguments <= 0); returns the sum. */
static inline float exp_shifted(float *restrict s, int w, float mx) {
    int j = 0;
    float sum = 0.0f;
#ifdef HAVE_AVX2
    const __m256 vmx = _mm256_set1_ps(mx), lo = _mm256_set1_ps(-87.0f), log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c_hi = _mm256_set1_ps(0.693145751953125f), c_lo = _mm256_set1_ps(1.428606765330187e-06f);
    __m256 vsum = _mm256_setzero_ps();
    for (; j + 8 <= w; j += 8) { /* exp_nonpositive, eight at a time */
        __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx), lo);
        __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(k, c_lo, _mm256_fnmadd_ps(k, c_hi, x));
        __m256 p = _mm256_set1_ps(1.0f / 720.0f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        _mm256_storeu_ps(s + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    sum = hsum8(vsum);
#endif
    for (; j < w; j++) {
        s[j] = exp_nonpositive(s[j] - mx);
        sum += s[j];
    }
    return sum;
}

/* One task: G query heads against w keys of one KV head. Writes m[G] (max score), l[G]
 * (sum of exp(score - m)) and acc[G][DV] (exp-weighted values). kbuf/vbuf: the keys and
 * values in float32, row strides ks/vs; s: [G][w] scratch. */
static void attend_chunk(const float *restrict qf, int group, int w, int D, int DV, const float *restrict kbuf,
                         int64_t ks, const float *restrict vbuf, int64_t vs, float *restrict s, float *restrict m,
                         float *restrict l, float *restrict acc) {
    for (int g = 0; g < group; g++) {
        float *sg = s + (int64_t)g * w;
        scores(qf + (int64_t)g * D, kbuf, w, D, ks, sg);
        float mx = sg[0];
#pragma omp simd reduction(max : mx)
        for (int j = 1; j < w; j++) mx = sg[j] > mx ? sg[j] : mx;
        const float sum = exp_shifted(sg, w, mx);
        m[g] = mx;
        l[g] = sum;
        weighted_sum(sg, vbuf, w, DV, vs, acc + (int64_t)g * DV);
    }
}

#ifdef HAVE_AVX512
#include "cpu_paged_decode_avx512.h"
#endif

/* Returns 0, or a negative code for arguments the kernel does not take. */
int devin_paged_decode_attention(
    const void *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows,
    const void *k_cache, int64_t k_block_stride, int64_t k_slot_stride, int64_t k_head_stride,
    const void *v_cache, int64_t v_block_stride, int64_t v_slot_stride, int64_t v_head_stride,
    const int32_t *tables, int64_t table_stride, const int32_t *lens,
    void *out, int64_t out_row_stride, int64_t out_head_stride,
    float *mass, int64_t mass_row_stride, int64_t mass_head_stride,
    int n, int num_kv_heads, int group, int head_dim, int v_head_dim, int block_size,
    float scale, int dtype, int num_threads, int chunk) {
    if (group < 1 || group > MAX_GROUP || head_dim < 1 || head_dim > MAX_DIM || v_head_dim < 1 ||
        v_head_dim > MAX_DIM || chunk < 1 || chunk > MAX_CHUNK || block_size < 1 || n < 0 || num_kv_heads < 1)
        return -1;
#ifndef __FLT16_MAX__
    if (dtype == DT_F16) return -2;
#endif
    /* tasks: (sequence, chunk) pairs, each for every KV head */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!first) return -3;
    first[0] = 0;
    int64_t keys = 0;
    for (int b = 0; b < n; b++) {
        int len = lens[b] > 0 ? lens[b] : 0;
        first[b + 1] = first[b] + (len + chunk - 1) / chunk;
        keys += len;
    }
    /* A step with little work (a batch-1 decode at a short context) runs on the calling thread:
     * waking a second thread costs more than the work (SmolLM2, 64 keys, 2-core Zen 4 under load:
     * 11 us on one thread, 71 us on two). Same tasks either way, so the same result. */
    if (keys * num_kv_heads * group * (int64_t)(head_dim + v_head_dim) < serial_work()) num_threads = 1;
    int64_t nchunks = first[n];
    int64_t ntasks = nchunks * num_kv_heads;
    int32_t *task_seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(nchunks > 0 ? nchunks : 1));
    const int64_t part = (int64_t)group * (v_head_dim + 2); /* m[G], l[G], acc[G][Dv] */
    float *partial = (float *)malloc(sizeof(float) * (size_t)(ntasks > 0 ? ntasks * part : 1));
    /* with a mass output: every task's exp(score - its max), [G][chunk], kept for the merge */
    float *probs = mass ? (float *)malloc(sizeof(float) * (size_t)(ntasks > 0 ? ntasks : 1) * group * chunk) : NULL;
    if (!task_seq || !partial || (mass && !probs)) {
        free(first);
        free(task_seq);
        free(partial);
        free(probs);
        return -3;
    }
    for (int b = 0; b < n; b++)
        for (int64_t c = first[b]; c < first[b + 1]; c++) task_seq[c] = b;
    int failed = 0;
#ifdef HAVE_AVX512
    /* head dims in whole 16-lane vectors: the AVX-512 task, reading keys and values in place */
    const int wide = head_dim % 16 == 0 && v_head_dim % 16 == 0;
    const DecodeArgs args = {q, q_row_stride, q_head_stride, q_rows, k_cache, k_block_stride, k_slot_stride,
                             k_head_stride, v_cache, v_block_stride, v_slot_stride, v_head_stride, tables,
                             table_stride, num_kv_heads, group, head_dim, v_head_dim, block_size, scale};
    if (wide)
        failed = run_tasks16(&args, dtype, first, task_seq, lens, nchunks, chunk, partial, part, probs, num_threads);
#else
    const int wide = 0;
#endif

    if (!wide) /* the portable task: the chunk gathered to float32 first */
#pragma omp parallel num_threads(num_threads)
    {
        /* per-thread scratch: this chunk's keys and values (all KV heads) in float32, scores, queries */
        const int64_t ks = (int64_t)num_kv_heads * head_dim, vs = (int64_t)num_kv_heads * v_head_dim;
        float *kbuf = (float *)malloc(sizeof(float) * (size_t)chunk * (size_t)ks);
        float *vbuf = (float *)malloc(sizeof(float) * (size_t)chunk * (size_t)vs);
        float *s = (float *)malloc(sizeof(float) * (size_t)chunk * (size_t)group);
        float *qf = (float *)malloc(sizeof(float) * (size_t)group * (size_t)head_dim);
        if (!kbuf || !vbuf || !s || !qf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < nchunks; c++) {
            if (!kbuf || !vbuf || !s || !qf) continue;
            const int b = task_seq[c];
            const int j0 = (int)(c - first[b]) * chunk;
            const int len = lens[b];
            const int j1 = j0 + chunk < len ? j0 + chunk : len;
            const int w = j1 - j0;
            const int32_t *table = tables + (int64_t)b * table_stride;
            gather_rows(k_cache, k_block_stride, k_slot_stride, k_head_stride, num_kv_heads, table, block_size, j0,
                        j1, dtype, head_dim, kbuf);
            gather_rows(v_cache, v_block_stride, v_slot_stride, v_head_stride, num_kv_heads, table, block_size, j0,
                        j1, dtype, v_head_dim, vbuf);
            for (int h = 0; h < num_kv_heads; h++) {
                const int64_t t = c * num_kv_heads + h;
                for (int g = 0; g < group; g++) {
                    float *qg = qf + (int64_t)g * head_dim;
                    load_row(q, q_rows[b] * q_row_stride + (int64_t)(h * group + g) * q_head_stride, dtype, head_dim,
                             qg);
                    for (int d = 0; d < head_dim; d++) qg[d] *= scale;
                }
                float *pp = partial + t * part;
                attend_chunk(qf, group, w, head_dim, v_head_dim, kbuf + h * head_dim, ks, vbuf + h * v_head_dim, vs,
                             s, pp, pp + group, pp + 2 * group);
                if (probs) memcpy(probs + t * group * chunk, s, sizeof(float) * (size_t)group * (size_t)w);
            }
        }
        free(kbuf);
        free(vbuf);
        free(s);
        free(qf);
    }
    if (failed) {
        free(first);
        free(task_seq);
        free(partial);
        free(probs);
        return -3;
    }

    /* merge each (sequence, KV head)'s chunks by log-sum-exp and write the output rows; with a
     * mass output, also each key's softmax weight summed over the G query heads */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t bh = 0; bh < (int64_t)n * num_kv_heads; bh++) {
        const int b = (int)(bh / num_kv_heads);
        const int h = (int)(bh % num_kv_heads);
        float res[MAX_DIM], mx[MAX_GROUP], inv[MAX_GROUP];
        for (int g = 0; g < group; g++) {
            mx[g] = -INFINITY;
            for (int64_t c = first[b]; c < first[b + 1]; c++) {
                const float mc = partial[(c * num_kv_heads + h) * part + g];
                mx[g] = mc > mx[g] ? mc : mx[g];
            }
            float denom = 0.0f;
            memset(res, 0, sizeof(float) * (size_t)v_head_dim);
            for (int64_t c = first[b]; c < first[b + 1]; c++) {
                const float *pp = partial + (c * num_kv_heads + h) * part;
                const float wgt = expf(pp[g] - mx[g]);
                denom += wgt * pp[group + g];
                const float *a = pp + 2 * group + (int64_t)g * v_head_dim;
                for (int d = 0; d < v_head_dim; d++) res[d] += wgt * a[d];
            }
            inv[g] = denom > 0.0f ? 1.0f / denom : 0.0f; /* no keys: zeros */
            for (int d = 0; d < v_head_dim; d++) res[d] *= inv[g];
            store_row(out, q_rows[b] * out_row_stride + (int64_t)(h * group + g) * out_head_stride, dtype,
                      v_head_dim, res);
        }
        if (!probs) continue;
        for (int64_t c = first[b]; c < first[b + 1]; c++) {
            const int64_t t = c * num_kv_heads + h;
            const int j0 = (int)(c - first[b]) * chunk;
            const int w = (j0 + chunk < lens[b] ? j0 + chunk : lens[b]) - j0;
            float *dst = mass + (int64_t)b * mass_row_stride + (int64_t)h * mass_head_stride + j0;
            for (int j = 0; j < w; j++) dst[j] = 0.0f;
            for (int g = 0; g < group; g++) {
                const float wgt = expf(partial[t * part + g] - mx[g]) * inv[g];
                const float *pg = probs + t * group * chunk + (int64_t)g * w;
                for (int j = 0; j < w; j++) dst[j] += wgt * pg[j];
            }
        }
    }
    free(probs);
    free(first);
    free(task_seq);
    free(partial);
    return 0;
}

/* Write one step's new keys and values into the pool: token t goes to flat slot slots[t]
 * (block slots[t] / block_size, offset slots[t] % block_size); slots < 0 (padded entries) are
 * skipped. New rows and pool share the dtype (elem_size bytes per element), so this is a copy.
 * Returns 0, or -1 for a slot past num_slots (nothing is written then). */
int devin_paged_write_kv(const void *k_new, int64_t kn_row_stride, int64_t kn_head_stride, const void *v_new,
                         int64_t vn_row_stride, int64_t vn_head_stride, const int64_t *slots, int n_tokens,
                         void *k_cache, int64_t k_block_stride, int64_t k_slot_stride, int64_t k_head_stride,
                         void *v_cache, int64_t v_block_stride, int64_t v_slot_stride, int64_t v_head_stride,
                         int num_kv_heads, int head_dim, int v_head_dim, int block_size, int64_t num_slots,
                         int elem_size) {
    for (int t = 0; t < n_tokens; t++)
        if (slots[t] >= num_slots) return -1;
    for (int t = 0; t < n_tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int64_t blk = s / block_size, off = s % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            memcpy((char *)k_cache + (blk * k_block_stride + off * k_slot_stride + h * k_head_stride) * elem_size,
                   (const char *)k_new + (t * kn_row_stride + h * kn_head_stride) * elem_size,
                   (size_t)head_dim * elem_size);
            memcpy((char *)v_cache + (blk * v_block_stride + off * v_slot_stride + h * v_head_stride) * elem_size,
                   (const char *)v_new + (t * vn_row_stride + h * vn_head_stride) * elem_size,
                   (size_t)v_head_dim * elem_size);
        }
    }
    return 0;
}
