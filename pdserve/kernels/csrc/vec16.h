/* Sixteen float32 lanes with GCC's vector extensions (one AVX-512 register, two AVX2 ones,
 * or whatever the target has), and the few operations the kernels need on them. */
#ifndef PDSERVE_VEC16_H
#define PDSERVE_VEC16_H

#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  /* unaligned access */
typedef int32_t i16 __attribute__((vector_size(64)));

#define SPLAT(x) ((v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x})

static inline v16 load16(const float *p) { return *(const v16u *)p; }
static inline void store16(float *p, v16 x) { *(v16u *)p = x; }

static inline v16 vselect(i16 take_a, v16 a, v16 b)
{
    return (v16)(((i16)a & take_a) | ((i16)b & ~take_a));
}

static inline v16 vmax(v16 a, v16 b) { return vselect(a > b, a, b); }
static inline v16 vmin(v16 a, v16 b) { return vselect(a < b, a, b); }

/* Horizontal sum and maximum: halve the vector four times (shuffles, not sixteen scalar steps). */
#define HALVE(x, op)                                                                        \
    x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5,    \
                                      6, 7));                                                \
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10,  \
                                      11));                                                  \
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12,  \
                                      13));                                                  \
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15,  \
                                      14))

static inline v16 vadd(v16 a, v16 b) { return a + b; }

static inline float hsum(v16 x)
{
    HALVE(x, vadd);
    return x[0];
}

static inline float hmax(v16 x)
{
    HALVE(x, vmax);
    return x[0];
}

/* e^x from n = round(x / ln 2) (integer lanes): 2^n e^r with r = x - n ln 2 (|r| <= ln(2) / 2)
 * and Cephes' expf polynomial for e^r (about 1 ulp). */
static inline v16 exp16_from(v16 x, i16 ni)
{
    const v16 n = __builtin_convertvector(ni, v16);
    const v16 r = x - n * SPLAT(0.693359375f) + n * SPLAT(2.12194440e-4f);
    v16 p = SPLAT(1.9875691500e-4f);
    p = p * r + SPLAT(1.3981999507e-3f);
    p = p * r + SPLAT(8.3334519073e-3f);
    p = p * r + SPLAT(4.1665795894e-2f);
    p = p * r + SPLAT(1.6666665459e-1f);
    p = p * r + SPLAT(5.0000001201e-1f);
    p = p * r * r + r + SPLAT(1.0f);
    return (v16)((i16)p + (ni << 23));
}

/* e^x for |x| <= 87 (clamped beyond). */
static inline v16 exp16(v16 x)
{
    x = vmin(vmax(x, SPLAT(-87.0f)), SPLAT(87.0f));
    const v16 y = x * SPLAT(1.44269504f) + SPLAT(0.5f);
    i16 ni = __builtin_convertvector(y, i16);             /* toward zero */
    ni += (i16)(__builtin_convertvector(ni, v16) > y);    /* true is -1: now floor(y) */
    return exp16_from(x, ni);
}

/* silu(g) * u = g / (1 + e^-g) * u: one expression for every kernel that computes it, so
 * they agree bit for bit. */
static inline v16 silu_mul16(v16 g, v16 u) { return g / (SPLAT(1.0f) + exp16(-g)) * u; }

/* e^x for x <= 0 (softmax's arguments), exactly 0 below -87 (so e^-inf is 0). Cheaper than
 * exp16: x / ln 2 - 1/2 is negative, so one conversion (toward zero) rounds x / ln 2. */
static inline v16 exp16_nonpos(v16 x)
{
    const i16 tiny = x < SPLAT(-87.0f);
    const i16 ni = __builtin_convertvector(x * SPLAT(1.44269504f) - SPLAT(0.5f), i16);
    return vselect(tiny, SPLAT(0.f), exp16_from(x, ni));
}

#endif
