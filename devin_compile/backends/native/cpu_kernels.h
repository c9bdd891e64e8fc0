/* Shared by the CPU C kernels (cpu_paged_decode.c, cpu_int4_linear.c, cpu_greedy.c, ...): dtype codes,
 * bf16/fp16 <-> float32 row conversion, AVX2 helpers, the AVX-512 feature macros and 16-lane loads. */
#ifndef DEVIN_CPU_KERNELS_H
#define DEVIN_CPU_KERNELS_H
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline void load_row(const void *base, int64_t off, int dt, int n, float *restrict dst) {
    if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(p[i]);
#ifdef __FLT16_MAX__
    } else if (dt == DT_F16) {
        const _Float16 *p = (const _Float16 *)base + off;
        for (int i = 0; i < n; i++) dst[i] = (float)p[i];
#endif
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void *base, int64_t off, int dt, int n, const float *restrict src) {
    if (dt == DT_BF16) {
        uint16_t *p = (uint16_t *)base + off;
        for (int i = 0; i < n; i++) p[i] = f32_to_bf16(src[i]);
#ifdef __FLT16_MAX__
    } else if (dt == DT_F16) {
        _Float16 *p = (_Float16 *)base + off;
        for (int i = 0; i < n; i++) p[i] = (_Float16)src[i];
#endif
    } else {
        memcpy((float *)base + off, src, (size_t)n * sizeof(float));
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1
/* sixteen elements at base + off (dtype dt) as float32 */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t off, int dt) {
    if (dt == DT_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
    return _mm512_loadu_ps((const float *)base + off);
}
#ifdef __AVX512VNNI__
#define HAVE_AVX512_VNNI 1
#endif
#endif
#endif

#endif
