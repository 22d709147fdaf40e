/* cpu_lora.c's phase 1: the shrink (h = A @ x for a block of an adapter's
 * rows, one part, float32 sums, h rounded to bf16 in the bf16 call) and the
 * pack of B for the expand over packed B (B^T in float32; with AVX-512 BF16,
 * bf16 pairs of ranks per 32-bit word). Included by cpu_lora.c only, after
 * cpu_lora_vec.h and its constants and macros (LORA_DPBF16, NOINLINE). */
#ifndef KVLOOM_CPU_LORA_SHRINK_H
#define KVLOOM_CPU_LORA_SHRINK_H

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

#endif
