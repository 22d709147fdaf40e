/* The elementwise work around a Llama layer's matmuls, fused, for CPU ranks
 * in float32 (workerd/kernels/ops.py calls these through ctypes).
 *
 * torch's rms_norm on CPU is a composite of six ops (pow, mean, add, rsqrt,
 * mul, mul), each a dispatch and a pass over the activations; with the
 * residual add before it, a visible share of a small model's step
 * (docs/benchmarks.md, CPU kernels). Here one pass per
 * row adds the residual, sums the squares and a second writes the scaled
 * product. SiLU-and-mul likewise replaces a chunk, a silu and a mul, and
 * GELU(tanh)-and-mul (Gemma's gelu_pytorch_tanh) a chunk, a gelu and a mul.
 *
 * The arithmetic is HF's (mean of squares in float32, x * rsqrt(mean + eps),
 * then the weight; x / (1 + e^-x)); only the order of the squares' summation
 * and the exp differ, by an ulp or two.
 */

#include <stddef.h>
#include <stdint.h>

#include "cpu_math.h"

/* x (and residual) rows of `hidden` floats, x_stride / r_stride apart.
 * With residual: new_residual = x + residual, out = norm(new_residual);
 * without (NULL): out = norm(x). out and new_residual are contiguous. */
void kvloom_rms_norm_f32(const float *x, int64_t x_stride, const float *residual,
                         int64_t r_stride, const float *weight, int64_t rows, int64_t hidden,
                         float eps, float *out, float *new_residual) {
    const int64_t nv = hidden / 8;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *v = xr;
        if (residual != NULL) {
            const float *rr = residual + r * r_stride;
            float *nr = new_residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) nr[i] = xr[i] + rr[i];
            v = nr;
        }
        /* Eight partial sums: the loop vectorizes without reassociating
         * anything the compiler is not told to. */
        v8 acc = {0};
        for (int64_t c = 0; c < nv; c++) {
            v8 y = ((const v8 *)v)[c];
            acc += y * y;
        }
        float sum = hsum(acc);
        for (int64_t i = nv * 8; i < hidden; i++) sum += v[i] * v[i];
        float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (v[i] * scale);
    }
}

/* x rows of 2 * inter floats (gate then up), x_stride apart ->
 * out[r, i] = silu(gate[i]) * up[i], contiguous. */
void kvloom_silu_and_mul_f32(const float *x, int64_t x_stride, int64_t rows, int64_t inter,
                             float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            float g = gate[i];
            float silu = g / (1.0f + exp_clamped(-g));
            /* Below -88, e^-g overflows float (torch's silu is -0 there) and
             * the clamped exp would leave g / 1.7e38 instead. */
            silu = g < -88.0f ? -0.0f : silu;
            o[i] = silu * up[i];
        }
    }
}

/* As kvloom_silu_and_mul_f32 with GELU's tanh form,
 * 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), torch's
 * gelu(approximate="tanh"); tanh_fast is within ~1e-7 of tanhf. */
void kvloom_gelu_tanh_and_mul_f32(const float *x, int64_t x_stride, int64_t rows, int64_t inter,
                                  float *out) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            float g = gate[i];
            float inner = k0 * (g + k1 * g * g * g);
            o[i] = 0.5f * g * (1.0f + tanh_fast(inner)) * up[i];
        }
    }
}
