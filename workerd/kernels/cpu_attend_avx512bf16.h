/* attend_G_bf16 for CPUs with AVX-512 BF16 (included by cpu_paged_attention.c
 * when the compiler targets one: -march=native on such a machine).
 *
 * The same walk as the portable DEFINE_ATTEND (chunks of up to
 * KEYS_PER_CHUNK keys inside one block, online softmax, float32 scores and
 * sums), with the two steps that cost most on a bf16 cache done the way the
 * hardware allows:
 *
 * - q.k: vdpbf16ps multiplies 32 bf16 pairs a K row holds straight from the
 *   cache (no widening of K to float32 at all) into 16 float32 sums, the
 *   products exact and accumulated in float32 (the scores then go through
 *   the shared online_softmax, which scales and caps them). q
 *   arrives rounded to bf16 (the caller rounds it in both paths, as the
 *   reference's bf16 q is), so converting it to pairs loses nothing.
 * - p.V: each V row is widened 16 elements to one instruction pair and
 *   summed with the probabilities in float32, four 16-column slices of up to
 *   4 heads at a time, so up to 16 independent FMA chains hide FMA latency.
 *
 * Taken for head_dim a multiple of 32; other head sizes run the portable
 * code. */
#ifndef KVLOOM_CPU_ATTEND_AVX512BF16_H
#define KVLOOM_CPU_ATTEND_AVX512BF16_H

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define KVLOOM_HAVE_DPBF16 1
/* q of one head as bf16 pairs: head_dim <= 32 * MAX_DP_PAIRS. */
#define MAX_DP_PAIRS 8

static inline __m512 widen16_bf16(const bf16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* acc (G rows of head_dim floats) += sum_i p[g][i] * V row i, n rows
 * row_stride apart; S columns (16 each) from column slice c0. */
#define DP_PV_SLICES(G, S)                                                                   \
    {                                                                                        \
        __m512 b[G][S];                                                                      \
        for (int g = 0; g < G; g++)                                                          \
            for (int s2 = 0; s2 < S; s2++) b[g][s2] = _mm512_loadu_ps(acc + g * head_dim + 16 * (c0 + s2)); \
        for (int64_t i = 0; i < n; i++) {                                                    \
            const bf16 *vi = v + i * row_stride + 16 * c0;                                   \
            __m512 y[S];                                                                     \
            for (int s2 = 0; s2 < S; s2++) y[s2] = widen16_bf16(vi + 16 * s2);               \
            for (int g = 0; g < G; g++) {                                                    \
                __m512 p = _mm512_set1_ps(sc[g][i]);                                         \
                for (int s2 = 0; s2 < S; s2++) b[g][s2] = _mm512_fmadd_ps(p, y[s2], b[g][s2]); \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; g++)                                                          \
            for (int s2 = 0; s2 < S; s2++) _mm512_storeu_ps(acc + g * head_dim + 16 * (c0 + s2), b[g][s2]); \
    }

#define DEFINE_ATTEND_DP(G)                                                                  \
    static void attend_dp_##G(const float *q, int64_t head_dim, const void *k_cache,        \
                              const void *v_cache, int64_t row_stride, const int64_t *blocks,\
                              int64_t block_size, int64_t first, int64_t num_keys,         \
                              float qk_scale, float cap, float *acc, void *out,             \
                              int64_t out_head_stride) {                                    \
        const int64_t npairs = head_dim / 32, nslices = head_dim / 16;                      \
        __m512bh qb[G][MAX_DP_PAIRS];                                                        \
        for (int g = 0; g < G; g++)                                                          \
            for (int64_t c = 0; c < npairs; c++)                                             \
                qb[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * head_dim + 32 * c + 16), \
                                               _mm512_loadu_ps(q + g * head_dim + 32 * c));  \
        float m[G], l[G], sc[G][KEYS_PER_CHUNK];                                             \
        for (int g = 0; g < G; g++) {                                                        \
            m[g] = -INFINITY;                                                                \
            l[g] = 0.0f;                                                                     \
        }                                                                                    \
        memset(acc, 0, sizeof(float) * G * head_dim);                                        \
        for (int64_t start = first; start < num_keys;) {                                     \
            int64_t in_block = start % block_size;                                           \
            int64_t n = block_size - in_block;                                               \
            if (n > KEYS_PER_CHUNK) n = KEYS_PER_CHUNK;                                      \
            if (n > num_keys - start) n = num_keys - start;                                  \
            int64_t slot = blocks[start / block_size] * block_size + in_block;               \
            const bf16 *k = (const bf16 *)k_cache + slot * row_stride;                       \
            const bf16 *v = (const bf16 *)v_cache + slot * row_stride;                       \
            for (int64_t j = 0; j < n; j++) {                                                \
                const bf16 *kj = k + j * row_stride;                                         \
                __m512 a[G];                                                                 \
                for (int g = 0; g < G; g++) a[g] = _mm512_setzero_ps();                      \
                for (int64_t c = 0; c < npairs; c++) {                                       \
                    __m512bh x = (__m512bh)_mm512_loadu_si512(kj + 32 * c);                  \
                    for (int g = 0; g < G; g++) a[g] = _mm512_dpbf16_ps(a[g], qb[g][c], x);  \
                }                                                                            \
                for (int g = 0; g < G; g++) sc[g][j] = _mm512_reduce_add_ps(a[g]);            \
            }                                                                                \
            for (int g = 0; g < G; g++)                                                      \
                online_softmax(sc[g], n, qk_scale, cap, &m[g], &l[g], acc + g * head_dim,    \
                               head_dim);                                                    \
            int64_t c0 = 0;                                                                  \
            for (; c0 + 4 <= nslices; c0 += 4) DP_PV_SLICES(G, 4)                            \
            for (; c0 < nslices; c0++) DP_PV_SLICES(G, 1)                                    \
            start += n;                                                                      \
        }                                                                                    \
        for (int g = 0; g < G; g++) {                                                        \
            float inv = 1.0f / l[g];                                                         \
            bf16 *o = (bf16 *)out + g * out_head_stride;                                     \
            const float *ag = acc + g * head_dim;                                            \
            for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_bf16(ag[d] * inv);          \
        }                                                                                    \
    }

DEFINE_ATTEND_DP(1)
DEFINE_ATTEND_DP(2)
DEFINE_ATTEND_DP(3)
DEFINE_ATTEND_DP(4)

#endif
#endif
