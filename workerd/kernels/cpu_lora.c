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

/* The work items' code, by phase; this file groups a call's rows by adapter,
 * checks the call and shares its items among threads. */
#include "cpu_lora_vec.h"
#include "cpu_lora_shrink.h"
#include "cpu_lora_expand.h"

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
