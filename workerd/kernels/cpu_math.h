/* Shared by kvloom's CPU kernels (the .c files beside it): an exp that
 * vectorizes and the 8-float vector type. */
#ifndef KVLOOM_CPU_MATH_H
#define KVLOOM_CPU_MATH_H

#include <math.h>
#include <stdint.h>

/* e^x for x <= 88, Cephes' expf polynomial: within 2 ulp of expf (checked
 * against exp over [-80, 0]), and branch-free so loops over it vectorize.
 * Below -87 it returns ~1e-38 rather than 0, which only ever multiplies terms
 * already negligible (beside a softmax maximum's 1, or in 1 + e^x). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float f = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* tanh(y) = sign(y) (1 - e) / (1 + e) with e = e^(-2|y|) <= 1, over
 * exp_clamped: branch-free, so the soft-cap loop vectorizes where libm's
 * tanhf is a call per score (Gemma 2's cap doubled a prefill layer's cost,
 * docs/benchmarks.md, "Model families"). Absolute error ~1e-7: the cap
 * multiplies it by c, far below the 1e-4 the parity tests hold. */
static inline float tanh_fast(float y) {
    float e = exp_clamped(-2.0f * fabsf(y));
    return copysignf((1.0f - e) / (1.0f + e), y);
}

/* Eight floats; loads and stores through it may be unaligned (the cache's
 * rows are 4-byte aligned only). GCC lowers it to AVX (or SSE, NEON) itself. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

#endif
