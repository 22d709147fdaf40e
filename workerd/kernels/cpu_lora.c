/* Batched multi-LoRA for CPU ranks, float32 or bfloat16 (issue 46;
 * workerd/kernels/lora.py calls it through ctypes).
 *
 * One call adds, for one linear layer of one step, every request's adapter
 * delta to the layer's output rows:
 *
 *     for each segment (row_start, row_end, a), each part p of adapter a:
 *         y[t, col_off : col_off + n_out] += B @ (A @ x[t])   for t in the rows
 *
 * with table[a, p] = (A, B, rank, col_off, n_out), A [rank, n_in] and
 * B [n_out, rank] contiguous (A == 0: no such part). A layer whose output
 * is several projections at once (qkv, gate_up) has a part per projection.
 *
 * The per-token way (vLLM's CPU punica path: gather an A and a B per token,
 * then a batched matmul) reads every weight once per token and copies it
 * first. Here the rows are grouped by adapter, wherever their segments sit
 * in the step, so an adapter's A and B are read once per block of its rows:
 * a decode step's requests on one adapter share every load, and a prefill's
 * hundreds of rows run as a small blocked matmul.
 *
 * Two phases, each a list of independent work items:
 *
 *   1. shrink: h[i, :rank] = A @ x[row i] for every listed row and part, in
 *      float32 (h is scratch, [rows listed, sum of the parts' ranks]). The
 *      inner product runs along n_in, contiguous in both x and A, on tiles
 *      of up to 4 rows x 16 ranks of 16-float partial sums, which a tree of
 *      shuffles then folds into one vector of totals (cheaper than a
 *      horizontal sum per accumulator). With AVX-512 BF16, bf16 x and A go
 *      straight into vdpbf16ps: 32 exact products per instruction, summed in
 *      float32, nothing widened.
 *      In bf16, h is then rounded to bf16, as a bf16 lora_A's output is in
 *      PEFT and in torch's two bf16 matmuls: the expand can then multiply it
 *      by vdpbf16ps too, at twice the float32 FMA's rate. The rounding moves
 *      the delta by 2^-8 of its terms at most, against y's own rounding to
 *      bf16 of the whole sum; everything else is float32 sums.
 *   1b. pack: for an adapter with PACK_MIN_ROWS rows or more, B is
 *      transposed once per call (float32 [rank, n_out]; bf16 with AVX-512
 *      BF16: pairs of ranks per 32-bit word), so the expand's vectors run
 *      along output columns.
 *   2. expand: y[t, cols] += h[t] @ B^T, rounding y once (bf16: y =
 *      bf16(float(y) + delta)). Over packed B: tiles of 4 rows x 64 columns,
 *      one B vector load for 4 rows, one h broadcast for 4 vectors. For an
 *      adapter with fewer rows (decode), straight from B as stored: 16
 *      columns' dot products along rank, folded by the same shuffle tree, as
 *      many FMAs as over packed B and no transpose to pay for.
 *
 * Work items are (adapter, block of its rows, part[, block of columns]);
 * each is computed the same way whichever thread runs it, so results do not
 * depend on the thread count. (Whether an adapter's B is packed depends on
 * how many of the call's rows it has, so a row's float32 rounding may.) A
 * call too small to share (a few decode rows) runs on the calling thread;
 * one whose segments overlap (a row listed twice) or whose parts' columns
 * overlap also does, as its additions to one element would otherwise race.
 *
 * Every index is checked before x or y is read or written: segments within
 * [0, n_rows), adapter indices within the table, every present part's rank
 * in [1, 512] and columns within y. The pointers in the table are the
 * caller's to vouch for (lora.py's lora_table checks the tensors' shapes).
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_math.h"
#include "cpu_parallel.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LORA_DPBF16 1
#endif

#define NOINLINE static __attribute__((noinline))
#define INLINE static inline __attribute__((always_inline))
/* Before each loop over a tile's rows, ranks or vectors (constant, small
 * trip counts): fully unrolled, its arrays of vectors become registers.
 * Left to its size limits, GCC kept the bf16 expand tile's (larger,
 * with the rounding) unrolled only in part, and its accumulators on the
 * stack. */
#define UNROLL _Pragma("GCC unroll 16")

#define MAX_RANK 512
#define TABLE_FIELDS 5
/* Rows of one adapter per work item: h's block stays in L1 beside the
 * 64-column slice of packed B the expand reuses across them. */
#define ROW_BLOCK 16
/* Output columns per expand work item (a multiple of 64). */
#define COL_BLOCK 256
/* An adapter with at least this many rows in the call gets its B packed.
 * The expand's FMAs are as many either way; B as stored costs a fold per 16
 * columns per row, packing a transpose of all of B per call (a rank 64
 * gate_up's 200k elements, more than 8 decode rows' expand). On the AVX-512
 * BF16 box (decode steps of 1 to 16 rows per adapter) packing paid from
 * about 12 rows. (-D overrides it, to measure another.) */
#ifndef PACK_MIN_ROWS
#define PACK_MIN_ROWS 12
#endif
/* Multiply-adds below which a call stays on one thread: waking the pool
 * costs a few microseconds, what ~250k multiply-adds take on one core. */
#define MIN_PARALLEL_MACS 262144

enum {
    LORA_OK = 0,
    LORA_ERR_SHAPE = 1,    /* sizes or strides the kernel does not take */
    LORA_ERR_SEGMENT = 2,  /* a segment's rows outside [0, n_rows), or start > end */
    LORA_ERR_ADAPTER = 3,  /* a segment's adapter index outside the table */
    LORA_ERR_RANK = 4,     /* a present part's rank outside [1, MAX_RANK] */
    LORA_ERR_COLUMNS = 5,  /* a present part's columns outside y */
    LORA_ERR_NULL_B = 6,   /* a present part with output columns but no B */
    LORA_ERR_NOMEM = 7,
};

/* 16 floats (AVX-512: one register; GCC splits it elsewhere). Unaligned,
 * as rows start wherever their tensors put them. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef bf16 bf16x16 __attribute__((vector_size(32), aligned(2)));

/* A loaded vector stays in its register: without this GCC re-reads each
 * x and A vector from memory for every FMA that uses it (folding the load
 * into the FMA), twice the loads of the shrink tile, which then ran at half
 * the FMA rate. */
#if defined(__AVX512F__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)  /* v16 spans several registers here */
#endif

/* Elements i .. i + 15 of a float32 or bf16 array as floats. */
INLINE v16 load16(const void *p, int64_t i, const int is_bf16) {
#ifdef __AVX512F__
    /* One vpmovzxwd to 16 lanes (GCC's own lowering of the conversion below
     * goes through two 8-lane halves). */
    if (is_bf16)
        return (v16)_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const bf16 *)p + i))),
            16);
#endif
    if (is_bf16)
        return (v16)(__builtin_convertvector(*(const bf16x16 *)((const bf16 *)p + i), u32x16)
                     << 16);
    return *(const v16 *)((const float *)p + i);
}

/* Store 16 floats at p[i ..], bf16 rounded to nearest even as f32_to_bf16
 * (not vcvtneps2bf16: it flushes denormals, torch does not). */
INLINE void store16(void *p, int64_t i, v16 v, const int is_bf16) {
    if (!is_bf16) {
        *(v16 *)((float *)p + i) = v;
        return;
    }
    u32x16 u = (u32x16)v;
    u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    u32x16 nan = (u32x16)(v != v);
    u32x16 quiet = (u >> 16) | 0x40u;
    u32x16 bits = (rounded & ~nan) | (quiet & nan);
#ifdef __AVX512F__
    _mm256_storeu_si256((__m256i *)((bf16 *)p + i), _mm512_cvtepi32_epi16((__m512i)bits));
#else
    *(bf16x16 *)((bf16 *)p + i) = __builtin_convertvector(bits, bf16x16);
#endif
}

/* The shuffle tree: fold(a, b) with width w adds each 2w-lane block's two
 * halves, a's into the block's first w lanes and b's into its last w. Four
 * levels (w = 8, 4, 2, 1) take 16 vectors to one whose lane L holds the sum
 * of all lanes of vector bitrev(L) (L's four bits reversed): 15 folds of two
 * shuffles and an add, against ~8 operations for each horizontal sum. */
static const i32x16 FOLD8_LO = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const i32x16 FOLD4_LO = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
static const i32x16 FOLD2_LO = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
static const i32x16 FOLD1_LO = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
/* Lane L of the tree's result belongs to vector BITREV[L] (and vice versa). */
static const i32x16 BITREV = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

INLINE v16 fold(v16 a, v16 b, i32x16 lo, int w) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, lo + w);
}

/* The last three levels, from 8 vectors whose lanes 0-7 and 8-15 each
 * belong to one sum (vector i: sums 2i and 2i + 1). Returns the 16 sums in
 * order (lane j: sum j). */
INLINE v16 fold_from8(const v16 *l1) {
    v16 l2[4], l3[2];
    UNROLL
    for (int i = 0; i < 4; i++) l2[i] = fold(l1[2 * i], l1[2 * i + 1], FOLD4_LO, 4);
    UNROLL
    for (int i = 0; i < 2; i++) l3[i] = fold(l2[2 * i], l2[2 * i + 1], FOLD2_LO, 2);
    return __builtin_shuffle(fold(l3[0], l3[1], FOLD1_LO, 1), BITREV);
}

/* Lane j: the sum of all lanes of acc[j], for 16 vectors. */
INLINE v16 sum16(const v16 *acc) {
    v16 l1[8];
    UNROLL
    for (int i = 0; i < 8; i++) l1[i] = fold(acc[2 * i], acc[2 * i + 1], FOLD8_LO, 8);
    return fold_from8(l1);
}

/* ---- Phase 1: shrink ---------------------------------------------------- */

/* h[t * hs + r] = sum_k A[r, k] x[xo[t] + k] for t < T, r < R (A at the
 * tile's first rank), T * R <= 16 accumulators of 16 lanes along k. */
INLINE void shrink_tile(const void *x, const int64_t *xo, const void *A, int64_t n_in, float *h,
                        int64_t hs, const int T, const int R, const int is_bf16) {
    v16 acc[16];
    UNROLL
    for (int i = 0; i < 16; i++) acc[i] = (v16){0};
    int64_t k = 0;
#ifdef LORA_DPBF16
    if (is_bf16) {
        /* 32 bf16 pairs per instruction, products exact, sums in float32. */
        for (; k + 32 <= n_in; k += 32) {
            __m512bh xv[4];
            UNROLL
            for (int t = 0; t < T; t++)
                xv[t] = (__m512bh)_mm512_loadu_si512((const bf16 *)x + xo[t] + k);
            UNROLL
            for (int r = 0; r < R; r++) {
                __m512bh av = (__m512bh)_mm512_loadu_si512((const bf16 *)A + r * n_in + k);
                UNROLL
                for (int t = 0; t < T; t++)
                    acc[t * R + r] = (v16)_mm512_dpbf16_ps((__m512)acc[t * R + r], xv[t], av);
            }
        }
    }
#endif
    for (; k + 16 <= n_in; k += 16) {
        v16 xv[4];
        UNROLL
        for (int t = 0; t < T; t++) {
            v16 v = load16(x, xo[t] + k, is_bf16);
            KEEP_IN_REGISTER(v);
            xv[t] = v;
        }
        UNROLL
        for (int r = 0; r < R; r++) {
            v16 av = load16(A, r * n_in + k, is_bf16);
            KEEP_IN_REGISTER(av);
            UNROLL
            for (int t = 0; t < T; t++) acc[t * R + r] += xv[t] * av;
        }
    }
    float sums[16];
    *(v16 *)sums = sum16(acc);
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int r = 0; r < R; r++) {
            float s = sums[t * R + r];
            for (int64_t kk = k; kk < n_in; kk++)
                s += get_elem(x, xo[t] + kk, is_bf16) * get_elem(A, r * n_in + kk, is_bf16);
            /* bf16: rounded, as a bf16 lora_A's output is (PEFT's, torch's
             * bf16 matmul); exact in the pairs the bf16 expand multiplies. */
            h[t * hs + r] = round_to(s, is_bf16);
        }
}

/* h[i * hs + r] = A[r] . x[rows[i]] for i < n, r < rank: tiles of 4 rows x
 * 4 ranks where there are 4 rows (each x and A vector loaded feeds four
 * sums), 2 x 8 or 1 x 16 for the last rows (decode) so there are still
 * enough independent sums to hide the FMA latency. */
INLINE void shrink_rows(const void *x, int64_t x_stride, int64_t n_in, const int64_t *rows,
                        int64_t n, const void *A, int64_t rank, float *h, int64_t hs,
                        const int is_bf16) {
    const size_t es = is_bf16 ? sizeof(bf16) : sizeof(float);
    for (int64_t t0 = 0; t0 < n;) {
        int64_t xo[4];
        const int64_t left = n - t0;
        const int T = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        for (int t = 0; t < T; t++) xo[t] = rows[t0 + t] * x_stride;
        float *ht = h + t0 * hs;
        for (int64_t r0 = 0; r0 < rank;) {
            const int64_t rem = rank - r0;
            const char *Ar = (const char *)A + r0 * n_in * es;
            int R;
            if (T == 4) {
                R = rem >= 4 ? 4 : 1;
                if (R == 4) shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 4, 4, is_bf16);
                else shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 4, 1, is_bf16);
            } else if (T == 2) {
                R = rem >= 8 ? 8 : rem >= 4 ? 4 : 1;
                if (R == 8) shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 2, 8, is_bf16);
                else if (R == 4) shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 2, 4, is_bf16);
                else shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 2, 1, is_bf16);
            } else {
                R = rem >= 16 ? 16 : rem >= 8 ? 8 : rem >= 4 ? 4 : 1;
                if (R == 16) shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 1, 16, is_bf16);
                else if (R == 8) shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 1, 8, is_bf16);
                else if (R == 4) shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 1, 4, is_bf16);
                else shrink_tile(x, xo, Ar, n_in, ht + r0, hs, 1, 1, is_bf16);
            }
            r0 += R;
        }
        t0 += T;
    }
}

/* One function per element type, taking plain arguments: inside an OpenMP
 * region GCC reaches captured variables through a pointer and may leave the
 * loops unvectorized (as cpu_elementwise.c's *_part functions). */
NOINLINE void shrink_f32(const void *x, int64_t x_stride, int64_t n_in, const int64_t *rows,
                         int64_t n, const void *A, int64_t rank, float *h, int64_t hs) {
    shrink_rows(x, x_stride, n_in, rows, n, A, rank, h, hs, 0);
}

NOINLINE void shrink_bf16(const void *x, int64_t x_stride, int64_t n_in, const int64_t *rows,
                          int64_t n, const void *A, int64_t rank, float *h, int64_t hs) {
    shrink_rows(x, x_stride, n_in, rows, n, A, rank, h, hs, 1);
}

/* The packs go 16 columns at a time: each row of the packed copy gets one
 * whole cache line in a row, and the 16 rows of B being read stay in L1.
 * Column by column instead, every store went to another row n_out apart,
 * a multiple of 4 KiB for n_out 1536 or 3072, all in one L1 set: the rank
 * 64 gate_up pack took as long as its shrink. */
#define PACK_COLUMNS 16

/* bt[r * n_out + c] = B[c, r] as float32: B^T, so the expand's vectors run
 * along output columns. */
INLINE void pack_b(const void *B, int64_t rank, int64_t n_out, float *bt, const int is_bf16) {
    for (int64_t c0 = 0; c0 < n_out; c0 += PACK_COLUMNS) {
        const int64_t c1 = c0 + PACK_COLUMNS < n_out ? c0 + PACK_COLUMNS : n_out;
        for (int64_t r = 0; r < rank; r++)
            for (int64_t c = c0; c < c1; c++)
                bt[r * n_out + c] = get_elem(B, c * rank + r, is_bf16);
    }
}

NOINLINE void pack_f32(const void *B, int64_t rank, int64_t n_out, float *bt) {
    pack_b(B, rank, n_out, bt, 0);
}

#ifdef LORA_DPBF16
/* bf16 with AVX-512 BF16: B^T by pairs of ranks, one 32-bit word per pair and
 * column, bp[q * n_out + c] = (B[c, 2q], B[c, 2q + 1]) (an odd rank's last
 * partner 0): what vdpbf16ps multiplies a broadcast pair of h values by, 16
 * columns at a time. A pair is adjacent in B's row already. */
NOINLINE void pack_bf16(const void *B, int64_t rank, int64_t n_out, float *bt) {
    uint32_t *bp = (uint32_t *)bt;
    const bf16 *b = B;
    const int64_t npairs = (rank + 1) / 2;
    for (int64_t c0 = 0; c0 < n_out; c0 += PACK_COLUMNS) {
        const int64_t c1 = c0 + PACK_COLUMNS < n_out ? c0 + PACK_COLUMNS : n_out;
        for (int64_t q = 0; q < npairs; q++)
            for (int64_t c = c0; c < c1; c++) {
                const uint32_t lo = b[c * rank + 2 * q];
                const uint32_t hi = 2 * q + 1 < rank ? b[c * rank + 2 * q + 1] : 0;
                bp[q * n_out + c] = lo | hi << 16;
            }
    }
}
#else
NOINLINE void pack_bf16(const void *B, int64_t rank, int64_t n_out, float *bt) {
    pack_b(B, rank, n_out, bt, 1);
}
#endif

/* ---- Phase 2: expand ---------------------------------------------------- */

/* y[yo[t] + j] += sum_r h[t * hs + r] * bt[r * ldb + j] for t < T and
 * j < 16 * NV: T x NV accumulators, each B^T vector loaded once for T rows,
 * each h value broadcast once for NV vectors. */
INLINE void expand_tile(const float *h, int64_t hs, int64_t rank, const float *bt, int64_t ldb,
                        void *y, const int64_t *yo, const int T, const int NV,
                        const int is_bf16) {
    v16 acc[4][4];
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int v = 0; v < NV; v++) acc[t][v] = (v16){0};
    for (int64_t r = 0; r < rank; r++) {
        v16 b[4];
        UNROLL
        for (int v = 0; v < NV; v++) {
            v16 bv = *(const v16 *)(bt + r * ldb + 16 * v);
            KEEP_IN_REGISTER(bv);
            b[v] = bv;
        }
        UNROLL
        for (int t = 0; t < T; t++) {
            const float hv = h[t * hs + r];
            UNROLL
            for (int v = 0; v < NV; v++) acc[t][v] += hv * b[v];
        }
    }
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int v = 0; v < NV; v++)
            store16(y, yo[t] + 16 * v, load16(y, yo[t] + 16 * v, is_bf16) + acc[t][v], is_bf16);
}

INLINE void add_scalar(void *y, int64_t i, float delta, const int is_bf16) {
    put_elem(y, i, get_elem(y, i, is_bf16) + delta, is_bf16);
}

/* Rows rows[0 .. n) of y, columns [y_col, y_col + ncols), from packed
 * bt[r * ldb + j] (j relative to y_col) and h rows hs apart. */
INLINE void expand_packed(const float *h, int64_t hs, int64_t rank, const float *bt, int64_t ldb,
                          void *y, int64_t y_stride, const int64_t *rows, int64_t n,
                          int64_t y_col, int64_t ncols, const int is_bf16) {
    for (int64_t j = 0; j < ncols;) {
        /* 64 columns (4 vectors) while they last, then 16, then single ones. */
        const int NV = ncols - j >= 64 ? 4 : ncols - j >= 16 ? 1 : 0;
        if (NV == 0) {
            for (int64_t i = 0; i < n; i++) {
                const int64_t o = rows[i] * y_stride + y_col;
                for (int64_t c = j; c < ncols; c++) {
                    float s = 0.0f;
                    for (int64_t r = 0; r < rank; r++) s += h[i * hs + r] * bt[r * ldb + c];
                    add_scalar(y, o + c, s, is_bf16);
                }
            }
            break;
        }
        for (int64_t t0 = 0; t0 < n;) {
            int64_t yo[4];
            const int64_t left = n - t0;
            const int T = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            for (int t = 0; t < T; t++) yo[t] = rows[t0 + t] * y_stride + y_col + j;
            const float *ht = h + t0 * hs;
            if (NV == 4) {
                if (T == 4) expand_tile(ht, hs, rank, bt + j, ldb, y, yo, 4, 4, is_bf16);
                else if (T == 2) expand_tile(ht, hs, rank, bt + j, ldb, y, yo, 2, 4, is_bf16);
                else expand_tile(ht, hs, rank, bt + j, ldb, y, yo, 1, 4, is_bf16);
            } else {
                if (T == 4) expand_tile(ht, hs, rank, bt + j, ldb, y, yo, 4, 1, is_bf16);
                else if (T == 2) expand_tile(ht, hs, rank, bt + j, ldb, y, yo, 2, 1, is_bf16);
                else expand_tile(ht, hs, rank, bt + j, ldb, y, yo, 1, 1, is_bf16);
            }
            t0 += T;
        }
        j += 16 * NV;
    }
}

#ifdef LORA_DPBF16
/* The bf16 expand_tile over pair-packed B: y[yo[t] + j] += sum_q hp[t][q] .
 * bp[q][j], each vdpbf16ps 32 products (two ranks x 16 columns) into
 * float32 sums, twice the float32 FMA's rate, as torch's bf16 matmul. */
INLINE void expand_tile_dp(const uint32_t *hp, int64_t hps, int64_t npairs, const uint32_t *bp,
                           int64_t ldb, void *y, const int64_t *yo, const int T, const int NV) {
    __m512 acc[4][4];
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int v = 0; v < NV; v++) acc[t][v] = _mm512_setzero_ps();
    for (int64_t q = 0; q < npairs; q++) {
        __m512bh b[4];
        UNROLL
        for (int v = 0; v < NV; v++) {
            __m512i bv = _mm512_loadu_si512(bp + q * ldb + 16 * v);
            KEEP_IN_REGISTER(bv);
            b[v] = (__m512bh)bv;
        }
        UNROLL
        for (int t = 0; t < T; t++) {
            const __m512bh hv = (__m512bh)_mm512_set1_epi32((int)hp[t * hps + q]);
            UNROLL
            for (int v = 0; v < NV; v++) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], hv, b[v]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int v = 0; v < NV; v++)
            store16(y, yo[t] + 16 * v, load16(y, yo[t] + 16 * v, 1) + (v16)acc[t][v], 1);
}

static inline float pair_dot(uint32_t a, uint32_t b) {
    return bf16_to_f32((bf16)a) * bf16_to_f32((bf16)b) +
           bf16_to_f32((bf16)(a >> 16)) * bf16_to_f32((bf16)(b >> 16));
}

/* expand_packed for bf16 over pair-packed B (bp[q * ldb + j], j relative to
 * y_col) and h as pairs (hp rows hps words apart). */
NOINLINE void expand_packed_dp(const uint32_t *hp, int64_t hps, int64_t npairs,
                               const uint32_t *bp, int64_t ldb, void *y, int64_t y_stride,
                               const int64_t *rows, int64_t n, int64_t y_col, int64_t ncols) {
    for (int64_t j = 0; j < ncols;) {
        const int NV = ncols - j >= 64 ? 4 : ncols - j >= 16 ? 1 : 0;
        if (NV == 0) {
            for (int64_t i = 0; i < n; i++) {
                const int64_t o = rows[i] * y_stride + y_col;
                for (int64_t c = j; c < ncols; c++) {
                    float s = 0.0f;
                    for (int64_t q = 0; q < npairs; q++)
                        s += pair_dot(hp[i * hps + q], bp[q * ldb + c]);
                    put_elem(y, o + c, get_elem(y, o + c, 1) + s, 1);
                }
            }
            break;
        }
        for (int64_t t0 = 0; t0 < n;) {
            int64_t yo[4];
            const int64_t left = n - t0;
            const int T = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            for (int t = 0; t < T; t++) yo[t] = rows[t0 + t] * y_stride + y_col + j;
            const uint32_t *ht = hp + t0 * hps;
            if (NV == 4) {
                if (T == 4) expand_tile_dp(ht, hps, npairs, bp + j, ldb, y, yo, 4, 4);
                else if (T == 2) expand_tile_dp(ht, hps, npairs, bp + j, ldb, y, yo, 2, 4);
                else expand_tile_dp(ht, hps, npairs, bp + j, ldb, y, yo, 1, 4);
            } else {
                if (T == 4) expand_tile_dp(ht, hps, npairs, bp + j, ldb, y, yo, 4, 1);
                else if (T == 2) expand_tile_dp(ht, hps, npairs, bp + j, ldb, y, yo, 2, 1);
                else expand_tile_dp(ht, hps, npairs, bp + j, ldb, y, yo, 1, 1);
            }
            t0 += T;
        }
        j += 16 * NV;
    }
}
#endif

/* Whether expand_direct takes this rank: one vector holds two columns' B
 * rows (rank 8) or a column's holds whole vectors (multiples of 16). */
static inline int direct_rank(int64_t rank) { return rank == 8 || rank % 16 == 0; }

/* y[rows[i], y_col + j] += B[j] . h[i] for i < n, j < ncols, B as stored
 * ([ncols, rank] rows, rank contiguous): 16 columns' dot products as 16
 * vectors of partial products, folded by the shuffle tree into one vector
 * of 16 columns, for each row while those 16 rows of B are in L1. As many
 * FMAs as over packed B, plus the folds; for a few rows that is less than
 * packing B (a transpose of all of it) would cost. */
INLINE void expand_direct(const float *h, int64_t hs, int64_t rank, const void *B, void *y,
                          int64_t y_stride, const int64_t *rows, int64_t n, int64_t y_col,
                          int64_t ncols, const int is_bf16) {
    int64_t j = 0;
    if (rank == 8) {
        for (; j + 16 <= ncols; j += 16)
            for (int64_t i = 0; i < n; i++) {
                /* h twice: each vector of B holds two columns' rows. */
                const float *hi = h + i * hs;
                v16 hh;
                UNROLL
                for (int l = 0; l < 16; l++) hh[l] = hi[l & 7];
                v16 l1[8];
                UNROLL
                for (int l = 0; l < 8; l++) l1[l] = load16(B, (j + 2 * l) * 8, is_bf16) * hh;
                const int64_t yo = rows[i] * y_stride + y_col + j;
                store16(y, yo, load16(y, yo, is_bf16) + fold_from8(l1), is_bf16);
            }
    } else if (rank % 16 == 0) {
        const int64_t nq = rank / 16;
        for (; j + 16 <= ncols; j += 16)
            for (int64_t i = 0; i < n; i++) {
                const float *hi = h + i * hs;
                v16 acc[16];
                UNROLL
                for (int c = 0; c < 16; c++) {
                    const int64_t o = (j + c) * rank;
                    v16 sum = load16(B, o, is_bf16) * *(const v16 *)hi;
                    for (int64_t q = 1; q < nq; q++)
                        sum += load16(B, o + 16 * q, is_bf16) * *(const v16 *)(hi + 16 * q);
                    acc[c] = sum;
                }
                const int64_t yo = rows[i] * y_stride + y_col + j;
                store16(y, yo, load16(y, yo, is_bf16) + sum16(acc), is_bf16);
            }
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = j; c < ncols; c++) {
            float sum = 0.0f;
            for (int64_t r = 0; r < rank; r++)
                sum += get_elem(B, c * rank + r, is_bf16) * h[i * hs + r];
            add_scalar(y, rows[i] * y_stride + y_col + c, sum, is_bf16);
        }
}

#ifdef LORA_DPBF16
/* expand_direct for bf16 by vdpbf16ps: a B row's pairs of ranks times h's,
 * 32 products an instruction, no widening. Rank 16: a vector holds two
 * columns' rows (rank 8's layout in float32); a multiple of 32: a column's
 * row is whole vectors. hp: each row's h as pairs, rows hps words apart. */
static inline int direct_dp_rank(int64_t rank) { return rank == 16 || rank % 32 == 0; }

NOINLINE void expand_direct_dp(const uint32_t *hp, int64_t hps, int64_t rank, const bf16 *B,
                               void *y, int64_t y_stride, const int64_t *rows, int64_t n,
                               int64_t y_col, int64_t ncols) {
    int64_t j = 0;
    if (rank == 16) {
        for (; j + 16 <= ncols; j += 16)
            for (int64_t i = 0; i < n; i++) {
                uint32_t twice[16];  /* the row's 8 pairs, for both columns of a vector */
                UNROLL
                for (int l = 0; l < 16; l++) twice[l] = hp[i * hps + (l & 7)];
                const __m512bh hh = (__m512bh)_mm512_loadu_si512(twice);
                v16 l1[8];
                UNROLL
                for (int l = 0; l < 8; l++)
                    l1[l] = (v16)_mm512_dpbf16_ps(
                        _mm512_setzero_ps(), hh,
                        (__m512bh)_mm512_loadu_si512(B + (j + 2 * l) * 16));
                const int64_t yo = rows[i] * y_stride + y_col + j;
                store16(y, yo, load16(y, yo, 1) + fold_from8(l1), 1);
            }
    } else {
        const int64_t nv = rank / 32;
        for (; j + 16 <= ncols; j += 16)
            for (int64_t i = 0; i < n; i++) {
                const uint32_t *hi = hp + i * hps;
                v16 acc[16];
                UNROLL
                for (int c = 0; c < 16; c++) {
                    const bf16 *b = B + (j + c) * rank;
                    __m512 sum = _mm512_setzero_ps();
                    for (int64_t v = 0; v < nv; v++)
                        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(hi + 16 * v),
                                               (__m512bh)_mm512_loadu_si512(b + 32 * v));
                    acc[c] = (v16)sum;
                }
                const int64_t yo = rows[i] * y_stride + y_col + j;
                store16(y, yo, load16(y, yo, 1) + sum16(acc), 1);
            }
    }
    const int64_t npairs = rank / 2;
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = j; c < ncols; c++) {
            float sum = 0.0f;
            for (int64_t q = 0; q < npairs; q++) {
                uint32_t pair;
                memcpy(&pair, B + c * rank + 2 * q, sizeof pair);
                sum += pair_dot(hp[i * hps + q], pair);
            }
            add_scalar(y, rows[i] * y_stride + y_col + c, sum, 1);
        }
}
#endif

/* One expand work item: rows[0 .. n) (h rows hs apart), the part's output
 * columns [c0, c1) (relative to col_off), from packed bt (NULL: from B). */
INLINE void expand_item(const float *h, int64_t hs, int64_t rank, const void *B, const float *bt,
                        int64_t n_out, void *y, int64_t y_stride, const int64_t *rows, int64_t n,
                        int64_t col_off, int64_t c0, int64_t c1, const int is_bf16) {
    const size_t es = is_bf16 ? sizeof(bf16) : sizeof(float);
#ifdef LORA_DPBF16
    if (is_bf16 && (bt != NULL || direct_dp_rank(rank))) {
        /* h's rows (bf16 values already) as pairs of bf16, for vdpbf16ps. */
        uint32_t hp[ROW_BLOCK * (MAX_RANK / 2)];
        const int64_t npairs = (rank + 1) / 2;
        for (int64_t i = 0; i < n; i++)
            for (int64_t q = 0; q < npairs; q++) {
                union { float f; uint32_t u; } lo = {.f = h[i * hs + 2 * q]}, hi = {.f = 0.0f};
                if (2 * q + 1 < rank) hi.f = h[i * hs + 2 * q + 1];
                hp[i * npairs + q] = lo.u >> 16 | (hi.u & 0xffff0000u);
            }
        if (bt != NULL)
            expand_packed_dp(hp, npairs, npairs, (const uint32_t *)bt + c0, n_out, y, y_stride,
                             rows, n, col_off + c0, c1 - c0);
        else
            expand_direct_dp(hp, npairs, rank, (const bf16 *)B + c0 * rank, y, y_stride, rows, n,
                             col_off + c0, c1 - c0);
        return;
    }
#endif
    if (bt != NULL) {
        expand_packed(h, hs, rank, bt + c0, n_out, y, y_stride, rows, n, col_off + c0, c1 - c0,
                      is_bf16);
        return;
    }
    expand_direct(h, hs, rank, (const char *)B + c0 * rank * es, y, y_stride, rows, n,
                  col_off + c0, c1 - c0, is_bf16);
}

NOINLINE void expand_f32(const float *h, int64_t hs, int64_t rank, const void *B,
                         const float *bt, int64_t n_out, void *y, int64_t y_stride,
                         const int64_t *rows, int64_t n, int64_t col_off, int64_t c0, int64_t c1) {
    expand_item(h, hs, rank, B, bt, n_out, y, y_stride, rows, n, col_off, c0, c1, 0);
}

NOINLINE void expand_bf16(const float *h, int64_t hs, int64_t rank, const void *B,
                          const float *bt, int64_t n_out, void *y, int64_t y_stride,
                          const int64_t *rows, int64_t n, int64_t col_off, int64_t c0,
                          int64_t c1) {
    expand_item(h, hs, rank, B, bt, n_out, y, y_stride, rows, n, col_off, c0, c1, 1);
}

/* ---- The call: grouping, work items, threads ----------------------------- */

/* One present part of one adapter in the call. */
struct lora_part {
    const void *A, *B;
    float *bt;       /* B^T packed (pack_f32, pack_bf16), or NULL: expand from B */
    int64_t rank, col_off, n_out;
    int64_t h_col;   /* its ranks' first column in the adapter's h rows */
};

/* One adapter with rows in the call: its rows (in segment order), their h
 * rows and its parts. */
struct lora_group {
    const int64_t *rows;
    int64_t n;
    float *h;
    int64_t hs;      /* h's row stride: the sum of the parts' ranks */
    struct lora_part *parts;
    int64_t num_parts;
};

enum item_kind { ITEM_SHRINK, ITEM_PACK, ITEM_EXPAND };

/* A work item: group g's part p, its rows [r0, r1) (list positions) and,
 * for an expand, the part's output columns [c0, c1). */
struct lora_item {
    int32_t kind, g, p;
    int64_t r0, r1, c0, c1;
};

struct lora_call {
    const void *x;
    int64_t x_stride, n_in;
    void *y;
    int64_t y_stride;
    const struct lora_group *groups;
    const struct lora_item *items;
    int is_bf16;
};

static void run_item(const struct lora_call *call, int64_t i) {
    const struct lora_item *it = &call->items[i];
    const struct lora_group *g = &call->groups[it->g];
    const struct lora_part *p = &g->parts[it->p];
    float *h = g->h + it->r0 * g->hs + p->h_col;
    const int64_t *rows = g->rows + it->r0, n = it->r1 - it->r0;
    if (it->kind == ITEM_SHRINK) {
        if (call->is_bf16) shrink_bf16(call->x, call->x_stride, call->n_in, rows, n, p->A, p->rank, h, g->hs);
        else shrink_f32(call->x, call->x_stride, call->n_in, rows, n, p->A, p->rank, h, g->hs);
    } else if (it->kind == ITEM_PACK) {
        if (call->is_bf16) pack_bf16(p->B, p->rank, p->n_out, p->bt);
        else pack_f32(p->B, p->rank, p->n_out, p->bt);
    } else if (call->is_bf16) {
        expand_bf16(h, g->hs, p->rank, p->B, p->bt, p->n_out, call->y, call->y_stride, rows, n,
                    p->col_off, it->c0, it->c1);
    } else {
        expand_f32(h, g->hs, p->rank, p->B, p->bt, p->n_out, call->y, call->y_stride, rows, n,
                   p->col_off, it->c0, it->c1);
    }
}

static int check_call(int64_t n_rows, int64_t n_in, int64_t n_y, int64_t x_stride,
                      int64_t y_stride, const int64_t *segments, int64_t num_segments,
                      const int64_t *table, int64_t num_adapters, int64_t num_parts) {
    if (n_rows < 0 || n_in < 1 || n_y < 0 || x_stride < n_in || y_stride < n_y ||
        num_segments < 0 || num_adapters < 0 || num_parts < 0)
        return LORA_ERR_SHAPE;
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t *seg = segments + 3 * s;
        if (seg[0] < 0 || seg[0] > seg[1] || seg[1] > n_rows) return LORA_ERR_SEGMENT;
        if (seg[2] < 0 || seg[2] >= num_adapters) return LORA_ERR_ADAPTER;
    }
    /* Every present part of the table, used by this call or not: a table
     * with a bad entry is a bug wherever the entry is. */
    for (int64_t e = 0; e < num_adapters * num_parts; e++) {
        const int64_t *f = table + TABLE_FIELDS * e;
        if (f[0] == 0) continue;
        if (f[2] < 1 || f[2] > MAX_RANK) return LORA_ERR_RANK;
        /* col_off + n_out <= n_y, without the sum overflowing */
        if (f[3] < 0 || f[4] < 0 || f[3] > n_y || f[4] > n_y - f[3]) return LORA_ERR_COLUMNS;
        if (f[4] > 0 && f[1] == 0) return LORA_ERR_NULL_B;
    }
    return LORA_OK;
}

/* Carve n bytes, 64-aligned, from *at. */
static void *carve(char **at, size_t n) {
    void *p = *at;
    *at += (n + 63) & ~(size_t)63;
    return p;
}

static int lora_add(const void *x, int64_t x_stride, int64_t n_rows, int64_t n_in, void *y,
                    int64_t y_stride, int64_t n_y, const int64_t *segments, int64_t num_segments,
                    const int64_t *table, int64_t num_adapters, int64_t num_parts,
                    int64_t num_threads, int is_bf16) {
    int err = check_call(n_rows, n_in, n_y, x_stride, y_stride, segments, num_segments, table,
                         num_adapters, num_parts);
    if (err != LORA_OK || num_segments == 0 || num_parts == 0) return err;

    /* Rows per adapter, and whether any row is listed twice. */
    int64_t *count = calloc((size_t)num_adapters, sizeof(int64_t));
    unsigned char *seen = calloc((size_t)n_rows + 1, 1);
    if (count == NULL || seen == NULL) {
        free(count);
        free(seen);
        return LORA_ERR_NOMEM;
    }
    int overlap = 0;
    int64_t listed = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t *seg = segments + 3 * s;
        count[seg[2]] += seg[1] - seg[0];
        listed += seg[1] - seg[0];
        for (int64_t t = seg[0]; t < seg[1] && !overlap; t++) {
            overlap |= seen[t];
            seen[t] = 1;
        }
    }
    free(seen);

    /* The groups: adapters with rows and at least one part with columns. */
    int64_t num_groups = 0, h_floats = 0, bt_floats = 0, n_items = 0, macs = 0;
    for (int64_t a = 0; a < num_adapters; a++) {
        if (count[a] == 0) continue;
        int64_t hs = 0, present = 0, blocks = (count[a] + ROW_BLOCK - 1) / ROW_BLOCK;
        for (int64_t p = 0; p < num_parts; p++) {
            const int64_t *f = table + TABLE_FIELDS * (a * num_parts + p);
            if (f[0] == 0 || f[4] == 0) continue;
            present++;
            hs += f[2];
            if (count[a] >= PACK_MIN_ROWS || !direct_rank(f[2])) {
                bt_floats += f[2] * f[4];
                n_items++;  /* its pack */
            }
            n_items += blocks * (1 + (f[4] + COL_BLOCK - 1) / COL_BLOCK);
            macs += count[a] * f[2] * (n_in + f[4]);
            /* Two parts adding to the same columns of a row would race. */
            for (int64_t q = 0; q < p; q++) {
                const int64_t *o = table + TABLE_FIELDS * (a * num_parts + q);
                if (o[0] != 0 && o[4] != 0 && f[3] < o[3] + o[4] && o[3] < f[3] + f[4])
                    overlap = 1;
            }
        }
        if (present == 0) {
            count[a] = 0;  /* nothing to add to its rows */
            continue;
        }
        num_groups++;
        h_floats += count[a] * hs;
    }
    if (num_groups == 0) {
        free(count);
        return LORA_OK;
    }

    /* One allocation: groups, parts, items, the row list, h and packed B. */
    size_t bytes = 64 * 6 + sizeof(struct lora_group) * (size_t)num_groups +
                   sizeof(struct lora_part) * (size_t)(num_groups * num_parts) +
                   sizeof(struct lora_item) * (size_t)n_items +
                   sizeof(int64_t) * (size_t)listed + sizeof(float) * (size_t)h_floats +
                   sizeof(float) * (size_t)bt_floats;
    char *mem = malloc(bytes), *at = mem;
    if (mem == NULL) {
        free(count);
        return LORA_ERR_NOMEM;
    }
    struct lora_group *groups = carve(&at, sizeof(struct lora_group) * (size_t)num_groups);
    struct lora_part *parts = carve(&at, sizeof(struct lora_part) * (size_t)(num_groups * num_parts));
    struct lora_item *items = carve(&at, sizeof(struct lora_item) * (size_t)n_items);
    int64_t *row_list = carve(&at, sizeof(int64_t) * (size_t)listed);
    float *h_all = carve(&at, sizeof(float) * (size_t)h_floats);
    float *bt_all = carve(&at, sizeof(float) * (size_t)bt_floats);

    /* count[a] becomes the adapter's group index + 1 (0: none); each group's
     * rows are its segments' rows in segment order. */
    int64_t g = 0, list_at = 0;
    for (int64_t a = 0; a < num_adapters; a++) {
        if (count[a] == 0) continue;
        struct lora_group *gr = &groups[g];
        gr->rows = row_list + list_at;
        gr->n = 0;
        gr->parts = parts + g * num_parts;
        gr->num_parts = 0;
        gr->hs = 0;
        for (int64_t p = 0; p < num_parts; p++) {
            const int64_t *f = table + TABLE_FIELDS * (a * num_parts + p);
            if (f[0] == 0 || f[4] == 0) continue;
            struct lora_part *pt = &gr->parts[gr->num_parts++];
            pt->A = (const void *)(intptr_t)f[0];
            pt->B = (const void *)(intptr_t)f[1];
            pt->rank = f[2];
            pt->col_off = f[3];
            pt->n_out = f[4];
            pt->h_col = gr->hs;
            pt->bt = NULL;
            if (count[a] >= PACK_MIN_ROWS || !direct_rank(pt->rank)) {
                pt->bt = bt_all;
                bt_all += pt->rank * pt->n_out;
            }
            gr->hs += pt->rank;
        }
        list_at += count[a];
        count[a] = ++g;
    }
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t *seg = segments + 3 * s;
        if (count[seg[2]] == 0) continue;
        struct lora_group *gr = &groups[count[seg[2]] - 1];
        for (int64_t t = seg[0]; t < seg[1]; t++) ((int64_t *)gr->rows)[gr->n++] = t;
    }
    free(count);

    /* Items: packs and shrinks (phase 1), then expands (phase 2). */
    int64_t n1 = 0, n2 = 0;
    float *h_at = h_all;
    for (g = 0; g < num_groups; g++) {
        struct lora_group *gr = &groups[g];
        gr->h = h_at;
        h_at += gr->n * gr->hs;
        for (int32_t p = 0; p < gr->num_parts; p++) {
            if (gr->parts[p].bt != NULL)
                items[n1++] = (struct lora_item){ITEM_PACK, (int32_t)g, p, 0, 0, 0, 0};
            for (int64_t r0 = 0; r0 < gr->n; r0 += ROW_BLOCK)
                items[n1++] = (struct lora_item){ITEM_SHRINK, (int32_t)g, p, r0,
                                                 r0 + ROW_BLOCK < gr->n ? r0 + ROW_BLOCK : gr->n,
                                                 0, 0};
        }
    }
    /* Expands by column block, then rows: consecutive items (one thread's,
     * most often) reuse one slice of B from cache. */
    for (g = 0; g < num_groups; g++) {
        const struct lora_group *gr = &groups[g];
        for (int32_t p = 0; p < gr->num_parts; p++)
            for (int64_t c0 = 0; c0 < gr->parts[p].n_out; c0 += COL_BLOCK)
                for (int64_t r0 = 0; r0 < gr->n; r0 += ROW_BLOCK) {
                    const int64_t n_out = gr->parts[p].n_out;
                    items[n1 + n2++] = (struct lora_item){
                        ITEM_EXPAND, (int32_t)g, p, r0,
                        r0 + ROW_BLOCK < gr->n ? r0 + ROW_BLOCK : gr->n,
                        c0, c0 + COL_BLOCK < n_out ? c0 + COL_BLOCK : n_out};
                }
    }

    const struct lora_call call = {x, x_stride, n_in, y, y_stride, groups, items, is_bf16};
    int threads = overlap || macs < MIN_PARALLEL_MACS ? 1 : parallel_threads(n2, 2, num_threads);
    if (threads == 1) {
        for (int64_t i = 0; i < n1 + n2; i++) run_item(&call, i);
    } else {
        /* Items differ in size (a qkv part's 576 columns beside its 192):
         * handed out one at a time. The loop's barrier ends phase 1 (every
         * h row and packed B written) before any expand reads them. */
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n1; i++) run_item(&call, i);
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = n1; i < n1 + n2; i++) run_item(&call, i);
        }
    }
    free(mem);
    return LORA_OK;
}

/* x: [n_rows, n_in] rows x_stride elements apart; y: [n_rows, n_y] rows
 * y_stride apart, added to in place; segments: [num_segments, 3] int64
 * (row_start, row_end, adapter); table: [num_adapters, num_parts, 5] int64
 * (A pointer, B pointer, rank, col_off, n_out; A == 0: part absent), A
 * [rank, n_in] and B [n_out, rank] contiguous, of x's type; num_threads:
 * how many threads may share the call (torch's count). Returns LORA_OK or an
 * error code, in which case nothing has been read or written. float32 here;
 * in kvloom_lora_add_bf16 x, y, A and B are bfloat16 (sums in float32, y
 * rounded once). */
int kvloom_lora_add_f32(const float *x, int64_t x_stride, int64_t n_rows, int64_t n_in, float *y,
                        int64_t y_stride, int64_t n_y, const int64_t *segments,
                        int64_t num_segments, const int64_t *table, int64_t num_adapters,
                        int64_t num_parts, int64_t num_threads) {
    return lora_add(x, x_stride, n_rows, n_in, y, y_stride, n_y, segments, num_segments, table,
                    num_adapters, num_parts, num_threads, 0);
}

int kvloom_lora_add_bf16(const bf16 *x, int64_t x_stride, int64_t n_rows, int64_t n_in, bf16 *y,
                         int64_t y_stride, int64_t n_y, const int64_t *segments,
                         int64_t num_segments, const int64_t *table, int64_t num_adapters,
                         int64_t num_parts, int64_t num_threads) {
    return lora_add(x, x_stride, n_rows, n_in, y, y_stride, n_y, segments, num_segments, table,
                    num_adapters, num_parts, num_threads, 1);
}
