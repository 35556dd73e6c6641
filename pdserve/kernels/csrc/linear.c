/* y = x W^T (+ b) for float32 on CPUs, on a weight packed once into panels of 32 outputs.
 *
 *   panels   (ceil(n / 32), k, 32): panel p holds outputs 32p .. 32p+31 for every input k,
 *            zero past n, so one k step of a panel is two vector loads
 *   x        (rows, k), row stride x_stride;  out (rows, n), row stride out_stride
 *
 * Each output is one fused multiply-add chain over k in order, starting from the bias: a row's
 * result does not depend on which other rows share the call. Up to 14 rows share a panel's k
 * loop (28 accumulators, the weights loaded once for all of them); rows are taken in blocks
 * small enough for the cache, and a block's panels are split among OpenMP threads. A decode
 * step's few rows thus stream every weight once at memory speed, where general GEMMs spend
 * their time on packing and edge cases. While a panel's last group of rows runs, the next
 * panel is fetched into L2, so the next panel's first group does not wait on memory.
 */
#include <stddef.h>

#include "kernels.h"
#include "panel.h"

#define GROUP 14
#define BLOCK_BYTES (512 * 1024)  /* rows of x per block: about this much of them */

/* rows x 32 outputs of one panel: `mr` is a constant in every call, so the loops unroll.
 * `ahead` (k, 32) is fetched into L2 on the way: the next panel, or this one again. */
static inline __attribute__((always_inline)) void
panel_rows(int mr, const float *x, int64_t x_stride, const float *panel, int64_t k,
           const float *bias, float *out, int64_t out_stride, int64_t cols, const float *ahead)
{
    v16 acc[GROUP][2];  /* 28 of the 32 vector registers */
    panel_start(mr, acc, bias);
    for (int64_t i = 0; i < k; i++) {
        const v16 w0 = load16(panel + i * PANEL), w1 = load16(panel + i * PANEL + 16);
        __builtin_prefetch(panel + (i + 16) * PANEL);
        __builtin_prefetch(panel + (i + 16) * PANEL + 16);
        __builtin_prefetch(ahead + i * PANEL, 0, 2);
        __builtin_prefetch(ahead + i * PANEL + 16, 0, 2);
        panel_step(mr, acc, x, x_stride, i, w0, w1);
    }
    panel_store(mr, acc, out, out_stride, cols);
}

static void panel_group(int64_t mr, const float *x, int64_t x_stride, const float *panel,
                        int64_t k, const float *bias, float *out, int64_t out_stride,
                        int64_t cols, const float *ahead)
{
    switch (mr) {
#define CASE(m) case m:                                                                     \
        panel_rows(m, x, x_stride, panel, k, bias, out, out_stride, cols, ahead); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
    CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14)
#undef CASE
    }
}

void linear_f32(const float *x, int64_t x_stride, int64_t rows, const float *panels, int64_t n,
                int64_t k, const float *bias, float *out, int64_t out_stride, int num_threads)
{
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    int64_t block = BLOCK_BYTES / (4 * k) / GROUP * GROUP;
    if (block < GROUP) block = GROUP;
    #pragma omp parallel num_threads(num_threads)
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t r1 = r0 + block < rows ? r0 + block : rows;
        #pragma omp for schedule(guided)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
            float padded_bias[PANEL];
            const float *b = panel_bias(bias, c0, cols, padded_bias);
            /* groups of even size (32 rows: 11 + 11 + 10, not 14 + 14 + 4) */
            const int64_t groups = (r1 - r0 + GROUP - 1) / GROUP;
            /* the panel after this one, most often this thread's next, while the last group runs */
            const int64_t next = p + 1 < num_panels ? p + 1 : p;
            for (int64_t g = 0, r = r0; g < groups; g++) {
                const int64_t mr = (r1 - r) / (groups - g);
                panel_group(mr, x + r * x_stride, x_stride, panels + p * k * PANEL, k, b,
                            out + r * out_stride + c0, out_stride, cols,
                            panels + (g == groups - 1 ? next : p) * k * PANEL);
                r += mr;
            }
        }
    }
}
