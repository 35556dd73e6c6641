/* Float32 vectors of the target's native width with GCC's vector extensions: VL = 16 lanes
 * (one AVX-512 register), 8 (one AVX2 register) or 4 (one SSE or Arm NEON register), and the
 * few operations the kernels need on them. A vector wider than the target's registers would be
 * kept in memory by GCC (10-50x slower), so every kernel is written on VL lanes; results
 * differ between widths only where lanes are summed together (horizontal sums), not within a
 * lane's own chain (and, on x86 without FMA, where a multiply-add rounds twice). VREGS is the
 * number of vector registers, which sizes the kernels' register tiles: 32 with AVX-512 and on
 * 64-bit Arm, 16 on other x86 targets. */
#ifndef PDSERVE_VEC_H
#define PDSERVE_VEC_H

#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VL 8
#elif defined(__SSE2__) || defined(__ARM_NEON)
#define VL 4
#else
#error "the native kernels need x86-64's SSE2 or Arm's NEON vectors"
#endif

#if defined(__AVX512F__) || defined(__aarch64__)
#define VREGS 32
#else
#define VREGS 16
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));  /* unaligned access */
typedef int32_t vi __attribute__((vector_size(4 * VL)));

#if VL == 16
#define SPLAT(x) ((vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x})
#define LANE_INDICES {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#elif VL == 8
#define SPLAT(x) ((vf){x, x, x, x, x, x, x, x})
#define LANE_INDICES {0, 1, 2, 3, 4, 5, 6, 7}
#else
#define SPLAT(x) ((vf){x, x, x, x})
#define LANE_INDICES {0, 1, 2, 3}
#endif

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf x) { *(vfu *)p = x; }

static inline vf vselect(vi take_a, vf a, vf b)
{
    return (vf)(((vi)a & take_a) | ((vi)b & ~take_a));
}

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
static inline vf vmin(vf a, vf b) { return vselect(a < b, a, b); }

/* Horizontal sum and maximum: halve the vector log2(VL) times (shuffles, not VL scalar
 * steps); every lane ends with the result. */
#if VL == 16
#define HALVE(x, op)                                                                           \
    x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5,    \
                                      6, 7));                                                  \
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10,  \
                                      11));                                                    \
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12,  \
                                      13));                                                    \
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15,  \
                                      14))
#elif VL == 8
#define HALVE(x, op)                                                                           \
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));                          \
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));                          \
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6))
#else
#define HALVE(x, op)                                                                           \
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1));                                      \
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2))
#endif

static inline vf vadd(vf a, vf b) { return a + b; }

static inline float hsum(vf x)
{
    HALVE(x, vadd);
    return x[0];
}

static inline float hmax(vf x)
{
    HALVE(x, vmax);
    return x[0];
}

/* e^x from n = round(x / ln 2) (integer lanes): 2^n e^r with r = x - n ln 2 (|r| <= ln(2) / 2)
 * and Cephes' expf polynomial for e^r (about 1 ulp). */
static inline vf expv_from(vf x, vi ni)
{
    const vf n = __builtin_convertvector(ni, vf);
    const vf r = x - n * SPLAT(0.693359375f) + n * SPLAT(2.12194440e-4f);
    vf p = SPLAT(1.9875691500e-4f);
    p = p * r + SPLAT(1.3981999507e-3f);
    p = p * r + SPLAT(8.3334519073e-3f);
    p = p * r + SPLAT(4.1665795894e-2f);
    p = p * r + SPLAT(1.6666665459e-1f);
    p = p * r + SPLAT(5.0000001201e-1f);
    p = p * r * r + r + SPLAT(1.0f);
    return (vf)((vi)p + (ni << 23));
}

/* e^x for |x| <= 87 (clamped beyond). */
static inline vf expv(vf x)
{
    x = vmin(vmax(x, SPLAT(-87.0f)), SPLAT(87.0f));
    const vf y = x * SPLAT(1.44269504f) + SPLAT(0.5f);
    vi ni = __builtin_convertvector(y, vi);             /* toward zero */
    ni += (vi)(__builtin_convertvector(ni, vf) > y);    /* true is -1: now floor(y) */
    return expv_from(x, ni);
}

/* silu(g) * u = g / (1 + e^-g) * u: one expression for every kernel that computes it, so
 * they agree bit for bit. */
static inline vf silu_mulv(vf g, vf u) { return g / (SPLAT(1.0f) + expv(-g)) * u; }

/* e^x for x <= 0 (softmax's arguments), exactly 0 below -87 (so e^-inf is 0). Cheaper than
 * expv: x / ln 2 - 1/2 is negative, so one conversion (toward zero) rounds x / ln 2. */
static inline vf expv_nonpos(vf x)
{
    const vi tiny = x < SPLAT(-87.0f);
    const vi ni = __builtin_convertvector(x * SPLAT(1.44269504f) - SPLAT(0.5f), vi);
    return vselect(tiny, SPLAT(0.f), expv_from(x, ni));
}

#endif
