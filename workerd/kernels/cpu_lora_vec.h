/* cpu_lora.c's 16-float vectors: the v16 types, loads and stores of float32
 * or bf16 rows as floats, and the shuffle tree that folds 16 vectors' lanes
 * into one vector of their 16 sums, which the shrink and the expand from B
 * as stored share. Included by cpu_lora.c only, after its includes and its
 * INLINE and UNROLL. */
#ifndef KVLOOM_CPU_LORA_VEC_H
#define KVLOOM_CPU_LORA_VEC_H

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

#endif
