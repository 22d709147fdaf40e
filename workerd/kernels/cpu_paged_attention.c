/* Paged attention for CPU ranks in float32 or bfloat16: kvloom's `cpu` attention backend
 * (workerd/kernels/loader.py compiles it with the other kernels once per
 * machine and calls it through ctypes; no torch headers, so it builds quickly
 * with the machine's own compiler).
 *
 * One call per layer does what the torch backend does in a dozen ops: write
 * the step's new K/V into their cache slots, then let every query attend to
 * its own request's context straight from the cache blocks: no gather of the
 * context into a padded copy, no mask, no padding. Each (query token, KV
 * head) pair walks its context once, block by block, with an online softmax;
 * the query heads that share the KV head (GQA) reuse every K and V row it
 * loads.
 *
 * A layer's sliding window W (0: none) starts each query's walk at its first
 * visible key, max(0, pos + 1 - W), so blocks wholly before the window are
 * never touched (the controlplane may have freed them); a soft cap c (0:
 * none) turns each scaled score s into c * tanh(s / c) before the online
 * maximum sees it.
 *
 * One algorithm for both element types: kvloom_paged_attention_f32 and _bf16
 * are the same always-inlined function with the element type a constant (so
 * each compiles to its own specialised code), over attend_G_<type> from one
 * macro whose only type-dependent steps are loading 8 elements as 8 floats
 * and storing an output float. bf16 (q, k, v, the cache, the rotary tables,
 * the output) is read by shifting its bits into a float's high half (exact)
 * and written rounded to nearest even, as torch rounds; scores, the online
 * softmax and the weighted sums are float32 in both. A bf16 q is rounded to
 * bf16 after its rotation (as a bf16 model's rotary output is) and each
 * score scaled; a float32 q is scaled before the walk. Where the compiler
 * targets AVX-512 BF16, bf16 runs cpu_attend_avx512bf16.h's walk instead.
 *
 * A call's (query token, KV head) units are shared among torch's OpenMP
 * threads (loader.py links the library against the libgomp torch loaded);
 * every unit is computed the same way whichever thread takes it, so the
 * results do not depend on the thread count.
 *
 * Every index that comes from the step's metadata is checked before anything
 * is written (slots, block ids, lengths): a bad step is refused with an error
 * code, never turned into an out-of-bounds read or write. With a window only
 * the block-table entries some query reads are checked: those before the
 * earliest query's window may name freed blocks, and are never read.
 */

#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_math.h"
#include "cpu_parallel.h"

#define KEYS_PER_CHUNK 16

/* One head's chunk of n scores (s holds KEYS_PER_CHUNK) through the online
 * softmax, in both walks: each score scaled by qk_scale and soft-capped at
 * cap (0: none), then replaced by its weight against the running maximum *m
 * (keys past n weigh 0); when the maximum rises, the head's sums so far
 * (acc, head_dim floats) and total weight *l are rescaled to it. */
static inline void online_softmax(float *s, int64_t n, float qk_scale, float cap, float *m,
                                  float *l, float *acc, int64_t head_dim) {
    if (qk_scale != 1.0f)
        for (int64_t i = 0; i < n; i++) s[i] *= qk_scale;
    if (cap > 0.0f) {
        const float inv_cap = 1.0f / cap;
        for (int64_t i = 0; i < n; i++) s[i] = cap * tanh_fast(s[i] * inv_cap);
    }
    float cm = s[0];
    for (int64_t i = 1; i < n; i++) cm = s[i] > cm ? s[i] : cm;
    float new_m = cm > *m ? cm : *m;
    float sum = 0.0f;
    for (int64_t i = 0; i < KEYS_PER_CHUNK; i++) {
        /* all lanes, so the loop vectorizes; keys past n weigh 0 */
        float p = exp_clamped(s[i] - new_m);
        s[i] = i < n ? p : 0.0f;
        sum += s[i];
    }
    if (new_m != *m) {
        /* *m = -inf before the first chunk: all so far is 0 */
        float corr = *m == -INFINITY ? 0.0f : exp_clamped(*m - new_m);
        for (int64_t d = 0; d < head_dim; d++) acc[d] *= corr;
        *l *= corr;
        *m = new_m;
    }
    *l += sum;
}

#include "cpu_attend_avx512bf16.h"

/* The typed loads and stores of attend_G_<type> (cpu_bf16.h's conversions). */
static inline v8 load8_f32(const float *p) { return get8(p, 0, 0); }
static inline v8 load8_bf16(const bf16 *p) { return get8(p, 0, 1); }

static inline float store_f32(float x) { return x; }
static inline bf16 store_bf16(float x) { return f32_to_bf16(x); }

enum {
    KV_OK = 0,
    KV_ERR_SHAPE = 1,      /* sizes or strides the kernel does not take */
    KV_ERR_QUERY_LOC = 2,  /* query_start_loc not increasing from 0 to num_actual_tokens */
    KV_ERR_SEQ_LEN = 3,    /* a seq_len shorter than its query length or beyond the block table */
    KV_ERR_BLOCK_ID = 4,   /* a block id outside the cache */
    KV_ERR_SLOT = 5,       /* a slot outside the cache */
    KV_ERR_NOMEM = 6,
    KV_ERR_KIND = 7,       /* a negative window, or a soft cap not finite and >= 0 */
};

/* The first key a query at `pos` attends: 0 without a window. */
static inline int64_t first_key(int64_t pos, int64_t window) {
    int64_t k = window > 0 ? pos + 1 - window : 0;
    return k > 0 ? k : 0;
}


static int check_step(int64_t num_reqs, int64_t num_actual_tokens, const int64_t *query_start_loc,
                      const int64_t *seq_lens, const int64_t *block_table, int64_t bt_stride,
                      int64_t bt_cols, int64_t num_blocks, int64_t block_size,
                      const int64_t *slot_mapping, int64_t window) {
    if (query_start_loc[0] != 0 || query_start_loc[num_reqs] != num_actual_tokens)
        return KV_ERR_QUERY_LOC;
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t ql = query_start_loc[r + 1] - query_start_loc[r];
        if (ql < 0) return KV_ERR_QUERY_LOC;
        int64_t sl = seq_lens[r];
        if (sl < ql || sl > bt_cols * block_size) return KV_ERR_SEQ_LEN;
        const int64_t *bt = block_table + r * bt_stride;
        /* From the block of the earliest query's first key: what attend reads. */
        for (int64_t b = first_key(sl - ql, window) / block_size,
                     nb = (sl + block_size - 1) / block_size; b < nb; b++)
            if (bt[b] < 0 || bt[b] >= num_blocks) return KV_ERR_BLOCK_ID;
    }
    int64_t num_slots = num_blocks * block_size;
    for (int64_t t = 0; t < num_actual_tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return KV_ERR_SLOT;
    return KV_OK;
}

/* One query token against one KV head: out[g] for G query heads that share
 * it, G a compile-time constant so that the G accumulators of every loop stay
 * in registers. q holds those heads' rows already multiplied by the scale;
 * head_dim is a multiple of 8 (the caller checks); acc is G * head_dim floats.
 *
 * Per chunk of up to KEYS_PER_CHUNK keys (never crossing a block): the
 * scores of two keys at a time for all G heads (2G independent FMA chains,
 * each K row loaded once), the online-softmax update, then the weighted sum
 * of V rows, two 8-wide column slices at a time (again 2G chains, each
 * probability broadcast once). Single-chain loops were much slower: every
 * FMA waited for the previous one (docs/benchmarks.md, CPU kernels). */
#define DEFINE_ATTEND(G, T, SUFFIX)                                                         \
    static void attend_##G##_##SUFFIX(const float *q, int64_t head_dim, const void *k_cache,\
                           const void *v_cache, int64_t row_stride, const int64_t *blocks,  \
                           int64_t block_size, int64_t first, int64_t num_keys,             \
                           float qk_scale, float cap, float *acc, void *out,                \
                           int64_t out_head_stride) {                                       \
        const int64_t nv = head_dim / 8;                                                    \
        float m[G], l[G], s[G][KEYS_PER_CHUNK];                                             \
        for (int g = 0; g < G; g++) {                                                       \
            m[g] = -INFINITY;                                                               \
            l[g] = 0.0f;                                                                    \
        }                                                                                   \
        memset(acc, 0, sizeof(float) * G * head_dim);                                       \
        for (int64_t start = first; start < num_keys;) {                                    \
            int64_t in_block = start % block_size;                                          \
            int64_t n = block_size - in_block;                                              \
            if (n > KEYS_PER_CHUNK) n = KEYS_PER_CHUNK;                                     \
            if (n > num_keys - start) n = num_keys - start;                                 \
            int64_t slot = blocks[start / block_size] * block_size + in_block;              \
            const T *k = (const T *)k_cache + slot * row_stride;                            \
            const T *v = (const T *)v_cache + slot * row_stride;                            \
            int64_t j = 0;                                                                  \
            for (; j + 1 < n; j += 2) {                                                     \
                const T *k0 = k + j * row_stride, *k1 = k0 + row_stride;                    \
                v8 a0[G], a1[G];                                                            \
                for (int g = 0; g < G; g++) a0[g] = a1[g] = (v8){0};                        \
                for (int64_t c = 0; c < nv; c++) {                                          \
                    v8 x0 = load8_##SUFFIX(k0 + 8 * c), x1 = load8_##SUFFIX(k1 + 8 * c);    \
                    for (int g = 0; g < G; g++) {                                           \
                        v8 qg = ((const v8 *)(q + g * head_dim))[c];                        \
                        a0[g] += qg * x0;                                                   \
                        a1[g] += qg * x1;                                                   \
                    }                                                                       \
                }                                                                           \
                for (int g = 0; g < G; g++) {                                               \
                    s[g][j] = hsum(a0[g]);                                                  \
                    s[g][j + 1] = hsum(a1[g]);                                              \
                }                                                                           \
            }                                                                               \
            if (j < n) {                                                                    \
                const T *k0 = k + j * row_stride;                                           \
                v8 a0[G];                                                                   \
                for (int g = 0; g < G; g++) a0[g] = (v8){0};                                \
                for (int64_t c = 0; c < nv; c++)                                            \
                    for (int g = 0; g < G; g++)                                             \
                        a0[g] += ((const v8 *)(q + g * head_dim))[c] *                      \
                                 load8_##SUFFIX(k0 + 8 * c);                                \
                for (int g = 0; g < G; g++) s[g][j] = hsum(a0[g]);                          \
            }                                                                               \
            for (int g = 0; g < G; g++)                                                     \
                online_softmax(s[g], n, qk_scale, cap, &m[g], &l[g], acc + g * head_dim,    \
                               head_dim);                                                   \
            int64_t c = 0;                                                                  \
            for (; c + 1 < nv; c += 2) {                                                    \
                v8 b0[G], b1[G];                                                            \
                for (int g = 0; g < G; g++) {                                               \
                    b0[g] = ((v8 *)(acc + g * head_dim))[c];                                \
                    b1[g] = ((v8 *)(acc + g * head_dim))[c + 1];                            \
                }                                                                           \
                for (int64_t i = 0; i < n; i++) {                                           \
                    const T *vi = v + i * row_stride + 8 * c;                               \
                    v8 y0 = load8_##SUFFIX(vi), y1 = load8_##SUFFIX(vi + 8);                \
                    for (int g = 0; g < G; g++) {                                           \
                        float p = s[g][i];                                                  \
                        b0[g] += p * y0;                                                    \
                        b1[g] += p * y1;                                                    \
                    }                                                                       \
                }                                                                           \
                for (int g = 0; g < G; g++) {                                               \
                    ((v8 *)(acc + g * head_dim))[c] = b0[g];                                \
                    ((v8 *)(acc + g * head_dim))[c + 1] = b1[g];                            \
                }                                                                           \
            }                                                                               \
            if (c < nv) {                                                                   \
                v8 b0[G];                                                                   \
                for (int g = 0; g < G; g++) b0[g] = ((v8 *)(acc + g * head_dim))[c];        \
                for (int64_t i = 0; i < n; i++)                                             \
                    for (int g = 0; g < G; g++)                                             \
                        b0[g] += s[g][i] * load8_##SUFFIX(v + i * row_stride + 8 * c);      \
                for (int g = 0; g < G; g++) ((v8 *)(acc + g * head_dim))[c] = b0[g];        \
            }                                                                               \
            start += n;                                                                     \
        }                                                                                   \
        for (int g = 0; g < G; g++) {                                                       \
            float inv = 1.0f / l[g];                                                        \
            T *o = (T *)out + g * out_head_stride;                                          \
            const float *ag = acc + g * head_dim;                                           \
            for (int64_t d = 0; d < head_dim; d++) o[d] = store_##SUFFIX(ag[d] * inv);      \
        }                                                                                   \
    }

DEFINE_ATTEND(1, float, f32)
DEFINE_ATTEND(2, float, f32)
DEFINE_ATTEND(3, float, f32)
DEFINE_ATTEND(4, float, f32)
DEFINE_ATTEND(1, bf16, bf16)
DEFINE_ATTEND(2, bf16, bf16)
DEFINE_ATTEND(3, bf16, bf16)
DEFINE_ATTEND(4, bf16, bf16)

typedef void (*attend_fn)(const float *, int64_t, const void *, const void *, int64_t,
                          const int64_t *, int64_t, int64_t, int64_t, float, float, float *,
                          void *, int64_t);

/* [is_bf16][group width]: the widths the caller splits a GQA group into. */
static const attend_fn ATTEND[2][5] = {
    {NULL, attend_1_f32, attend_2_f32, attend_3_f32, attend_4_f32},
    {NULL, attend_1_bf16, attend_2_bf16, attend_3_bf16, attend_4_bf16},
};

/* x (head_dim elements) rotated as HF's NeoX-style rotary does: the two
 * halves of the head as a pair, x * cos + swap_halves(x) * signed_sin,
 * signed_sin being sin with its first half negated (workerd/layers/rotary.py).
 * x and the tables are src_bf16's type, dst dst_bf16's; the math is float32
 * and dst rounded once. */
static inline void rotate(const void *x, const void *cos, const void *signed_sin,
                          int64_t head_dim, float scale, void *dst, int src_bf16,
                          int dst_bf16) {
    int64_t half = head_dim / 2;
    /* Two loops, each over contiguous elements, so both vectorize. */
    for (int64_t d = 0; d < half; d++)
        put_elem(dst, d, (get_elem(x, d, src_bf16) * get_elem(cos, d, src_bf16) +
                          get_elem(x, d + half, src_bf16) * get_elem(signed_sin, d, src_bf16)) *
                             scale, dst_bf16);
    for (int64_t d = half; d < head_dim; d++)
        put_elem(dst, d, (get_elem(x, d, src_bf16) * get_elem(cos, d, src_bf16) +
                          get_elem(x, d - half, src_bf16) * get_elem(signed_sin, d, src_bf16)) *
                             scale, dst_bf16);
}

/* The body of both entry points below, inlined into each with is_bf16 a
 * constant: the element type of q, k, v, kv_cache, the rotary tables and
 * out. Strides are in elements. */
static inline __attribute__((always_inline)) int paged_attention(
    const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
    int64_t v_stride, void *kv_cache, int64_t num_blocks, int64_t block_size,
    const int64_t *slot_mapping, int64_t num_tokens, int64_t num_actual_tokens,
    const int64_t *query_start_loc, const int64_t *seq_lens, int64_t num_reqs,
    const int64_t *block_table, int64_t bt_stride, int64_t bt_cols, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, float soft_cap,
    const void *rope_cos, const void *rope_sin, void *out, int64_t num_threads,
    const int is_bf16) {
    if (num_reqs < 0 || num_tokens < num_actual_tokens || num_actual_tokens < 0 ||
        num_kv_heads <= 0 || head_dim <= 0 || head_dim % 8 || num_heads % num_kv_heads || block_size <= 0 ||
        num_blocks < 0 || bt_cols < 0 || bt_stride < bt_cols)
        return KV_ERR_SHAPE;
    if (window < 0 || !(soft_cap >= 0.0f) || isinf(soft_cap)) return KV_ERR_KIND;
    int rc = check_step(num_reqs, num_actual_tokens, query_start_loc, seq_lens, block_table,
                        bt_stride, bt_cols, num_blocks, block_size, slot_mapping, window);
    if (rc != KV_OK) return rc;
    const size_t esize = is_bf16 ? sizeof(bf16) : sizeof(float);
    /* Element offsets into the caller's arrays, as byte pointers. */
#define AT(p, i) ((const char *)(p) + (size_t)(i) * esize)
#define AT_MUT(p, i) ((char *)(p) + (size_t)(i) * esize)
    int64_t group = num_heads / num_kv_heads;
    /* The widest specialization that divides the group; a group of 8 runs
     * as two of 4, one of 5 as five of 1. */
    int64_t sub = group % 4 == 0 ? 4 : group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;
    attend_fn attend = ATTEND[is_bf16][sub];
#ifdef KVLOOM_HAVE_DPBF16
    static const attend_fn ATTEND_DP[5] = {NULL, attend_dp_1, attend_dp_2, attend_dp_3,
                                           attend_dp_4};
    if (is_bf16 && head_dim % 32 == 0 && head_dim <= 32 * MAX_DP_PAIRS) attend = ATTEND_DP[sub];
#endif
    int64_t width = num_kv_heads * head_dim; /* one slot's K (or V) */
    /* The work comes in units of one query token and one KV head, each
     * independent of the others once the step's K/V are in the cache. */
    int64_t units = num_actual_tokens * num_kv_heads;
    int threads = parallel_threads(units, 2, num_threads);
    float *scratch = malloc(sizeof(float) * 2 * sub * head_dim * threads);
    int64_t *req_of = malloc(sizeof(int64_t) * (num_actual_tokens > 0 ? num_actual_tokens : 1));
    if (scratch == NULL || req_of == NULL) {
        free(scratch);
        free(req_of);
        return KV_ERR_NOMEM;
    }
    for (int64_t r = 0; r < num_reqs; r++)
        for (int64_t t = query_start_loc[r]; t < query_start_loc[r + 1]; t++) req_of[t] = r;
    void *k_cache = kv_cache, *v_cache = AT_MUT(kv_cache, num_blocks * block_size * width);
    int64_t next_unit = 0; /* the units not yet taken, shared by the threads */
    /* float32 scales q before the walk (its results as they always were);
     * bf16 rounds the rotated q to bf16, as the reference's bf16 q is, and
     * scales each score, as the reference's attention does. */
    const float q_scale = is_bf16 ? 1.0f : scale, qk_scale = is_bf16 ? scale : 1.0f;

#pragma omp parallel num_threads(threads)
    {
        int tid = thread_index(), nt = thread_count();
        float *qs = scratch + (size_t)tid * 2 * sub * head_dim, *acc = qs + sub * head_dim;
        /* The step's K/V into their slots, a contiguous share of the tokens
         * each, all of them written before any thread reads the cache. */
        int64_t begin, end;
        thread_share(num_actual_tokens, tid, nt, &begin, &end);
        for (int64_t t = begin; t < end; t++) {
            void *k_slot = AT_MUT(k_cache, slot_mapping[t] * width);
            if (rope_cos == NULL) {
                memcpy(k_slot, AT(k, t * k_stride), esize * width);
            } else {
                for (int64_t h = 0; h < num_kv_heads; h++)
                    rotate(AT(k, t * k_stride + h * head_dim), AT(rope_cos, t * head_dim),
                           AT(rope_sin, t * head_dim), head_dim, 1.0f,
                           AT_MUT(k_slot, h * head_dim), is_bf16, is_bf16);
            }
            memcpy(AT_MUT(v_cache, slot_mapping[t] * width), AT(v, t * v_stride),
                   esize * width);
        }
#pragma omp barrier
        /* Units taken one at a time from a shared counter: a decode's unit
         * costs its context length, so a static split would leave a thread
         * idle behind the longest requests. */
        for (int64_t u; (u = __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED)) < units;) {
            int64_t t = u / num_kv_heads, h = u % num_kv_heads, r = req_of[t];
            int64_t ql = query_start_loc[r + 1] - query_start_loc[r];
            int64_t pos = seq_lens[r] - ql + (t - query_start_loc[r]);
            const int64_t *blocks = block_table + r * bt_stride;
            for (int64_t g0 = 0; g0 < group; g0 += sub) {
                int64_t head = h * group + g0;
                const void *qt = AT(q, t * q_stride + head * head_dim);
                if (rope_cos == NULL) {
                    for (int64_t e = 0; e < sub * head_dim; e++)
                        qs[e] = get_elem(qt, e, is_bf16) * q_scale;
                } else {
                    for (int64_t g = 0; g < sub; g++)
                        rotate(AT(qt, g * head_dim), AT(rope_cos, t * head_dim),
                               AT(rope_sin, t * head_dim), head_dim, q_scale,
                               qs + g * head_dim, is_bf16, 0);
                    if (is_bf16)
                        for (int64_t e = 0; e < sub * head_dim; e++) qs[e] = round_to(qs[e], 1);
                }
                attend(qs, head_dim, AT(k_cache, h * head_dim), AT(v_cache, h * head_dim),
                       width, blocks, block_size, first_key(pos, window), pos + 1, qk_scale,
                       soft_cap, acc, AT_MUT(out, t * num_heads * head_dim + head * head_dim),
                       head_dim);
            }
        }
    }
    free(scratch);
    free(req_of);
    memset(AT_MUT(out, num_actual_tokens * num_heads * head_dim), 0,
           esize * (num_tokens - num_actual_tokens) * num_heads * head_dim);
#undef AT
#undef AT_MUT
    return KV_OK;
}

/* q: [num_tokens, num_heads, head_dim] rows q_stride apart (heads contiguous);
 * k, v: [num_tokens, num_kv_heads, head_dim] rows k_stride / v_stride apart;
 * kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous;
 * rope_cos, rope_sin: NULL when q and k arrive rotated, else each token's
 * rotary tables ([num_tokens, head_dim] contiguous; cos and signed sin), and
 * q and k are rotated here (k on its way into the cache);
 * window: the layer's sliding window in tokens, 0 for none; soft_cap: its
 * logit soft cap, 0 for none;
 * out: [num_tokens, num_heads * head_dim] contiguous, rows past
 * num_actual_tokens (padding) set to 0; num_threads: how many threads may
 * share the call (torch's count). Returns KV_OK or an error code, in
 * which case nothing has been written. All float32 here; in
 * kvloom_paged_attention_bf16 every one of these arrays is bfloat16. */
#define PAGED_ATTENTION_ENTRY(SUFFIX, T, IS_BF16)                                              \
    int kvloom_paged_attention_##SUFFIX(                                                       \
        const T *q, int64_t q_stride, const T *k, int64_t k_stride, const T *v,                \
        int64_t v_stride, T *kv_cache, int64_t num_blocks, int64_t block_size,                 \
        const int64_t *slot_mapping, int64_t num_tokens, int64_t num_actual_tokens,            \
        const int64_t *query_start_loc, const int64_t *seq_lens, int64_t num_reqs,             \
        const int64_t *block_table, int64_t bt_stride, int64_t bt_cols, int64_t num_heads,     \
        int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, float soft_cap,   \
        const T *rope_cos, const T *rope_sin, T *out, int64_t num_threads) {                   \
        return paged_attention(q, q_stride, k, k_stride, v, v_stride, kv_cache, num_blocks,    \
                               block_size, slot_mapping, num_tokens, num_actual_tokens,        \
                               query_start_loc, seq_lens, num_reqs, block_table, bt_stride,    \
                               bt_cols, num_heads, num_kv_heads, head_dim, scale, window,      \
                               soft_cap, rope_cos, rope_sin, out, num_threads, IS_BF16);       \
    }

PAGED_ATTENTION_ENTRY(f32, float, 0)
PAGED_ATTENTION_ENTRY(bf16, bf16, 1)
