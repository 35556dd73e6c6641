/* Fused elementwise layers for CPUs, float32: one pass over memory where torch takes several
 * ops (and a Python dispatch for each).
 *
 *   rms_norm      out = x / sqrt(mean(x^2) + eps) * w                 rows of n values
 *   add_rms_norm  x += delta (in place), then out = rms_norm(x) * w
 *   silu_mul      out[r, i] = silu(gu[r, i]) * gu[r, n + i]           gu: rows of 2n values
 *   rotary        per row t and head j < heads, the halves (a, b) of x[t, j] become
 *                 (a cos - b sin, b cos + a sin) with row t of cos/sin: (rows, d/2)
 *                 (in place)
 * Row strides are in floats; rows are shared among OpenMP threads only when there are enough
 * of them (waking threads costs more than a decode step's few rows).
 */
#include "kernels.h"
#include "vec.h"

static void norm_row(const float *x, const float *w, float *out, int64_t n, float eps)
{
    vf acc = SPLAT(0.f);
    float tail = 0.f;
    int64_t i = 0;
    for (; i + VL <= n; i += VL) { const vf v = loadv(x + i); acc += v * v; }
    for (int64_t k = i; k < n; k++) tail += x[k] * x[k];
    const float inv = 1.0f / __builtin_sqrtf((hsum(acc) + tail) / (float)n + eps);
    for (i = 0; i + VL <= n; i += VL) storev(out + i, loadv(x + i) * SPLAT(inv) * loadv(w + i));
    for (; i < n; i++) out[i] = x[i] * inv * w[i];
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int64_t rows, int64_t n, float eps, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * x_stride, w, out + r * out_stride, n, eps);
}

void add_rms_norm_f32(float *x, int64_t x_stride, const float *delta, int64_t delta_stride,
                      const float *w, float *out, int64_t out_stride, int64_t rows, int64_t n,
                      float eps, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * x_stride;
        const float *dr = delta + r * delta_stride;
        int64_t i = 0;
        for (; i + VL <= n; i += VL) storev(xr + i, loadv(xr + i) + loadv(dr + i));
        for (; i < n; i++) xr[i] += dr[i];
        norm_row(xr, w, out + r * out_stride, n, eps);
    }
}

void silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t out_stride,
                  int64_t rows, int64_t n, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * gu_stride, *u = g + n;
        float *o = out + r * out_stride;
        int64_t i = 0;
        for (; i + VL <= n; i += VL) storev(o + i, silu_mulv(loadv(g + i), loadv(u + i)));
        for (; i < n; i++) o[i] = silu_mulv(SPLAT(g[i]), SPLAT(u[i]))[0];
    }
}

void rotary_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
                const float *cos, const float *sin, int num_threads)
{
    const int64_t half = head_dim / 2;
    #pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_VALUES)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t j = 0; j < heads; j++) {
            float *a = x + t * row_stride + j * head_dim, *b = a + half;
            int64_t i = 0;
            for (; i + VL <= half; i += VL) {
                const vf av = loadv(a + i), bv = loadv(b + i);
                const vf cv = loadv(c + i), sv = loadv(s + i);
                storev(a + i, av * cv - bv * sv);
                storev(b + i, bv * cv + av * sv);
            }
            for (; i < half; i++) {
                const float av = a[i], bv = b[i];
                a[i] = av * c[i] - bv * s[i];
                b[i] = bv * c[i] + av * s[i];
            }
        }
    }
}
