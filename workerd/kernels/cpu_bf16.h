/* bfloat16 for kvloom's CPU kernels: the storage type, torch's conversions
 * both ways, and element access that reads float32 or bf16 arrays alike, so
 * one loop serves both entry points of a kernel (is_bf16 is a constant
 * wherever these are inlined, and the branch folds away). The math is
 * always float32; a bf16 array is only where a value is stored, which is
 * where transformers' bf16 tensors round it. */
#ifndef KVLOOM_CPU_BF16_H
#define KVLOOM_CPU_BF16_H

#include <stdint.h>

#include "cpu_math.h"

/* bfloat16 as its bits. The vector type may be unaligned (a row starts
 * wherever the tensor puts it); GCC lowers the widening load to one
 * zero-extend and one shift per 8 elements (vpmovzxwd + vpslld on x86). */
typedef uint16_t bf16;
typedef bf16 bf16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline float bf16_to_f32(bf16 h) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)h << 16};
    return c.f;
}

/* Round to nearest even, NaN kept a (quiet) NaN: torch's float -> bfloat16. */
static inline bf16 f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16;
    return f != f ? (bf16)((c.u >> 16) | 0x40u) : (bf16)rounded;
}

/* Element i of an array of floats (is_bf16 0) or bf16 (1). */
static inline float get_elem(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void put_elem(void *p, int64_t i, float x, int is_bf16) {
    if (is_bf16)
        ((bf16 *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* Elements i .. i + 7 as floats. */
static inline v8 get8(const void *p, int64_t i, int is_bf16) {
    if (is_bf16)
        return (v8)(__builtin_convertvector(*(const bf16x8 *)((const bf16 *)p + i), u32x8) << 16);
    return *(const v8 *)((const float *)p + i);
}

/* x as an array of the type would hold it: a bf16 tensor's rounding point. */
static inline float round_to(float x, int is_bf16) {
    return is_bf16 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

#endif
