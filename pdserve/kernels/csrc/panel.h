/* A panel's rows x SPAN outputs in registers (two vectors a row): what linear.c (float32
 * weights) and linear_coded.c (weights rebuilt from fewer bytes) share, so that both run the
 * same multiply-add chain and give the same results bit for bit. With 16 lanes a pass covers
 * the panel's 32 outputs; with 8 lanes (AVX2) it covers 16 of them, twice; with 4 (SSE, Arm
 * NEON), 8 of them, four times. */
#ifndef PDSERVE_PANEL_H
#define PDSERVE_PANEL_H

#include <stdint.h>

#include "vec.h"

#define PANEL 32     /* outputs per panel */
#define SPAN (2 * VL)  /* outputs per pass over a panel's inputs */

/* The bias of the panel's outputs c0 .. c0 + cols, zero-padded to 32 in `padded`; NULL
 * without a bias. */
static inline const float *panel_bias(const float *bias, int64_t c0, int64_t cols,
                                      float padded[PANEL])
{
    if (!bias) return NULL;
    for (int64_t j = 0; j < PANEL; j++) padded[j] = j < cols ? bias[c0 + j] : 0.f;
    return padded;
}

/* acc[m] = the bias (or zero) of the pass's outputs for the mr rows. */
static inline __attribute__((always_inline)) void
panel_start(int mr, vf acc[][2], const float *bias)
{
    const vf b0 = bias ? loadv(bias) : SPLAT(0.f), b1 = bias ? loadv(bias + VL) : SPLAT(0.f);
    for (int m = 0; m < mr; m++) { acc[m][0] = b0; acc[m][1] = b1; }
}

/* acc[m] += x[m][i] * (w0, w1): one input's step of every row's fused multiply-add chain. */
static inline __attribute__((always_inline)) void
panel_step(int mr, vf acc[][2], const float *x, int64_t x_stride, int64_t i, vf w0, vf w1)
{
    for (int m = 0; m < mr; m++) {
        const vf xv = SPLAT(x[m * x_stride + i]);
        acc[m][0] += xv * w0;
        acc[m][1] += xv * w1;
    }
}

/* out[m][0 .. cols) = acc[m]: all SPAN outputs of the pass, or the first `cols` of the last
 * panel of an n that is not a multiple of 32. */
static inline __attribute__((always_inline)) void
panel_store(int mr, vf acc[][2], float *out, int64_t out_stride, int64_t cols)
{
    if (cols == SPAN) {
        for (int m = 0; m < mr; m++) {
            storev(out + m * out_stride, acc[m][0]);
            storev(out + m * out_stride + VL, acc[m][1]);
        }
        return;
    }
    for (int m = 0; m < mr; m++)
        for (int64_t j = 0; j < cols; j++)
            out[m * out_stride + j] = acc[m][j / VL][j % VL];
}

#endif
