/* The elementwise work around a Llama layer's matmuls, fused, for CPU ranks
 * in float32 or bfloat16 (workerd/kernels/ops.py calls these through ctypes).
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
 * and the exp differ, by an ulp or two. In bf16 the math is float32 too and
 * a value is rounded to bf16 exactly where transformers' bf16 tensors hold
 * it: the residual sum; Llama's normalised x before its bf16 weight (Gemma's
 * and OLMo 2's product by a float32 weight only once, at the end); the
 * activation before the multiply by up. A float32 rounding difference in
 * between moves a result by at most one bf16 ulp, and only where it sits on
 * a rounding boundary (tests/workerd/kernels/test_cpu_ops.py).
 *
 * Each kernel is one row loop over cpu_bf16.h's element access, inlined into
 * its float32 and bf16 entry points with is_bf16 a constant; a call's rows
 * are shared among torch's threads when it is large enough (cpu_parallel.h),
 * each row computed the same way on any of them.
 */

#include <stddef.h>
#include <stdint.h>

#include "cpu_bf16.h"
#include "cpu_math.h"
#include "cpu_parallel.h"

/* A call's rows are shared among threads only past this many elements: below
 * it (a decode step's norms) waking a second thread costs more than it saves. */
#define MIN_PARALLEL_ELEMENTS 16384
#define NOINLINE static __attribute__((noinline))

#define INLINE static inline __attribute__((always_inline))

/* x (and residual) rows of `hidden` elements, x_stride / r_stride apart.
 * With residual: new_residual = x + residual, out = norm(new_residual);
 * without (NULL): out = norm(x). out and new_residual are contiguous, of
 * x's type; weight is bf16 when w_bf16, else float. round_before_weight:
 * Llama's order (the normalised x stored, then multiplied by the weight),
 * else the product rounded once. */
INLINE void rms_norm_rows(const void *x, int64_t x_stride, const void *residual,
                          int64_t r_stride, const void *weight, int64_t rows, int64_t hidden,
                          float eps, void *out, void *new_residual, const int is_bf16,
                          const int w_bf16, const int round_before_weight) {
    const int64_t nv = hidden / 8;
    for (int64_t r = 0; r < rows; r++) {
        /* The row norm() reads: v[vo ..] */
        const void *v = x;
        int64_t vo = r * x_stride;
        if (residual != NULL) {
            const int64_t ro = r * r_stride;
            for (int64_t i = 0; i < hidden; i++)
                put_elem(new_residual, r * hidden + i,
                         get_elem(x, vo + i, is_bf16) + get_elem(residual, ro + i, is_bf16),
                         is_bf16);
            v = new_residual;
            vo = r * hidden;
        }
        /* Eight partial sums: the loop vectorizes without reassociating
         * anything the compiler is not told to. */
        v8 acc = {0};
        for (int64_t c = 0; c < nv; c++) {
            v8 y = get8(v, vo + 8 * c, is_bf16);
            acc += y * y;
        }
        float sum = hsum(acc);
        for (int64_t i = nv * 8; i < hidden; i++) {
            float y = get_elem(v, vo + i, is_bf16);
            sum += y * y;
        }
        float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) {
            float y = get_elem(v, vo + i, is_bf16) * scale;
            if (round_before_weight) y = round_to(y, is_bf16);
            put_elem(out, r * hidden + i, get_elem(weight, i, w_bf16) * y, is_bf16);
        }
    }
}

/* The three norms' specialisations of rms_norm_rows. */
enum norm_kind { NORM_F32, NORM_BF16, NORM_BF16_F32_WEIGHT };

/* One thread's rows. A function of its own, taking its pointers as plain
 * arguments: inside an OpenMP region GCC reaches the captured variables
 * through a pointer and left the row loops unvectorized (docs/benchmarks.md,
 * "Threads and the AVX-512 BF16 walk"). */
NOINLINE void rms_norm_part(const void *x, int64_t x_stride, const void *residual,
                            int64_t r_stride, const void *weight, int64_t rows, int64_t hidden,
                            float eps, void *out, void *new_residual, enum norm_kind kind) {
    if (kind == NORM_F32)
        rms_norm_rows(x, x_stride, residual, r_stride, weight, rows, hidden, eps, out,
                      new_residual, 0, 0, 1);
    else if (kind == NORM_BF16)  /* Llama's: bf16 weight, the normalised x rounded before it */
        rms_norm_rows(x, x_stride, residual, r_stride, weight, rows, hidden, eps, out,
                      new_residual, 1, 1, 1);
    else  /* Gemma's and OLMo 2's: a float32 weight ((1 + w) for Gemma), one rounding */
        rms_norm_rows(x, x_stride, residual, r_stride, weight, rows, hidden, eps, out,
                      new_residual, 1, 0, 0);
}

static void rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                     const void *weight, int64_t rows, int64_t hidden, float eps, void *out,
                     void *new_residual, enum norm_kind kind, int64_t num_threads) {
    int threads = rows * hidden < MIN_PARALLEL_ELEMENTS ? 1
                                                        : parallel_threads(rows, 2, num_threads);
    if (threads == 1) {
        rms_norm_part(x, x_stride, residual, r_stride, weight, rows, hidden, eps, out,
                      new_residual, kind);
        return;
    }
    const size_t es = kind == NORM_F32 ? sizeof(float) : sizeof(bf16);
#pragma omp parallel num_threads(threads)
    {
        int64_t b, e;
        thread_share(rows, thread_index(), thread_count(), &b, &e);
        rms_norm_part((const char *)x + b * x_stride * es,
                      x_stride, residual ? (const char *)residual + b * r_stride * es : NULL,
                      r_stride, weight, e - b, hidden, eps, (char *)out + b * hidden * es,
                      new_residual ? (char *)new_residual + b * hidden * es : NULL, kind);
    }
}

void kvloom_rms_norm_f32(const float *x, int64_t x_stride, const float *residual,
                         int64_t r_stride, const float *weight, int64_t rows, int64_t hidden,
                         float eps, float *out, float *new_residual, int64_t num_threads) {
    rms_norm(x, x_stride, residual, r_stride, weight, rows, hidden, eps, out, new_residual,
             NORM_F32, num_threads);
}

void kvloom_rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *residual,
                          int64_t r_stride, const bf16 *weight, int64_t rows, int64_t hidden,
                          float eps, bf16 *out, bf16 *new_residual, int64_t num_threads) {
    rms_norm(x, x_stride, residual, r_stride, weight, rows, hidden, eps, out, new_residual,
             NORM_BF16, num_threads);
}

void kvloom_rms_norm_bf16_f32_weight(const bf16 *x, int64_t x_stride, const bf16 *residual,
                                     int64_t r_stride, const float *weight, int64_t rows,
                                     int64_t hidden, float eps, bf16 *out, bf16 *new_residual,
                                     int64_t num_threads) {
    rms_norm(x, x_stride, residual, r_stride, weight, rows, hidden, eps, out, new_residual,
             NORM_BF16_F32_WEIGHT, num_threads);
}

enum activation { SILU, GELU_TANH };

/* 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) for GELU_TANH, torch's
 * gelu(approximate="tanh") (tanh_fast is within ~1e-7 of tanhf). */
INLINE float activate(float g, const enum activation act) {
    if (act == GELU_TANH) {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f;
        return 0.5f * g * (1.0f + tanh_fast(k0 * (g + k1 * g * g * g)));
    }
    /* Below -88, e^-g overflows float (torch's silu is -0 there) and the
     * clamped exp would leave g / 1.7e38 instead. */
    float silu = g / (1.0f + exp_clamped(-g));
    return g < -88.0f ? -0.0f : silu;
}

/* x rows of 2 * inter elements (gate then up), x_stride apart ->
 * out[r, i] = act(gate[i]) * up[i], contiguous; act(gate) is stored (in
 * bf16, rounded) before the multiply, as transformers' act_fn(gate) * up. */
INLINE void gated_rows(const void *x, int64_t x_stride, int64_t rows, int64_t inter, void *out,
                       const enum activation act, const int is_bf16) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gate = r * x_stride, up = gate + inter;
        for (int64_t i = 0; i < inter; i++) {
            float a = round_to(activate(get_elem(x, gate + i, is_bf16), act), is_bf16);
            put_elem(out, r * inter + i, a * get_elem(x, up + i, is_bf16), is_bf16);
        }
    }
}

/* One thread's rows (a function of its own for rms_norm_part's reason). */
NOINLINE void gated_part(const void *x, int64_t x_stride, int64_t rows, int64_t inter,
                         void *out, enum activation act, int is_bf16) {
    if (act == SILU)
        is_bf16 ? gated_rows(x, x_stride, rows, inter, out, SILU, 1)
                : gated_rows(x, x_stride, rows, inter, out, SILU, 0);
    else
        is_bf16 ? gated_rows(x, x_stride, rows, inter, out, GELU_TANH, 1)
                : gated_rows(x, x_stride, rows, inter, out, GELU_TANH, 0);
}

static void gated(const void *x, int64_t x_stride, int64_t rows, int64_t inter, void *out,
                  enum activation act, int is_bf16, int64_t num_threads) {
    int threads = rows * inter < MIN_PARALLEL_ELEMENTS ? 1
                                                       : parallel_threads(rows, 2, num_threads);
    if (threads == 1) {
        gated_part(x, x_stride, rows, inter, out, act, is_bf16);
        return;
    }
    const size_t es = is_bf16 ? sizeof(bf16) : sizeof(float);
#pragma omp parallel num_threads(threads)
    {
        int64_t b, e;
        thread_share(rows, thread_index(), thread_count(), &b, &e);
        gated_part((const char *)x + b * x_stride * es, x_stride, e - b, inter,
                   (char *)out + b * inter * es, act, is_bf16);
    }
}

void kvloom_silu_and_mul_f32(const float *x, int64_t x_stride, int64_t rows, int64_t inter,
                             float *out, int64_t num_threads) {
    gated(x, x_stride, rows, inter, out, SILU, 0, num_threads);
}

void kvloom_silu_and_mul_bf16(const bf16 *x, int64_t x_stride, int64_t rows, int64_t inter,
                              bf16 *out, int64_t num_threads) {
    gated(x, x_stride, rows, inter, out, SILU, 1, num_threads);
}

void kvloom_gelu_tanh_and_mul_f32(const float *x, int64_t x_stride, int64_t rows, int64_t inter,
                                  float *out, int64_t num_threads) {
    gated(x, x_stride, rows, inter, out, GELU_TANH, 0, num_threads);
}

void kvloom_gelu_tanh_and_mul_bf16(const bf16 *x, int64_t x_stride, int64_t rows,
                                   int64_t inter, bf16 *out, int64_t num_threads) {
    gated(x, x_stride, rows, inter, out, GELU_TANH, 1, num_threads);
}
