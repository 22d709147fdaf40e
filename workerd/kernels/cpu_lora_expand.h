/* cpu_lora.c's phase 2: the expand, y[rows, cols] += h @ B^T for one work
 * item (a block of an adapter's rows, one part, a block of its columns),
 * y rounded once. Over packed B (tiles of 4 rows x 64 columns) where the
 * call packed it, else straight from B as stored (16 columns' dot products
 * folded by the shuffle tree); bf16 with AVX-512 BF16 by vdpbf16ps where
 * the layout allows. Included by cpu_lora.c only, after cpu_lora_vec.h and
 * its constants and macros (MAX_RANK, ROW_BLOCK, LORA_DPBF16, NOINLINE). */
#ifndef KVLOOM_CPU_LORA_EXPAND_H
#define KVLOOM_CPU_LORA_EXPAND_H

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

#endif
