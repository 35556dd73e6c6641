/* y = x W^T (+ b) for float32 on CPUs, on a weight packed once into panels of 32 outputs.
 *
 *   panels   (ceil(n / 32), k, 32): panel p holds outputs 32p .. 32p+31 for every input k,
 *            zero past n, so one k step of a panel is two vector loads
 *   x        (rows, k), row stride x_stride;  out (rows, n), row stride out_stride
 *
 * Each output is one fused multiply-add chain over k in order, starting from the bias: a row's
 * result does not depend on which other rows share the call. Up to GROUP rows share a panel's k
 * loop (14 rows and 28 accumulators with 32 vector registers, 6 rows and 12 with AVX2's or
 * SSE's 16; a pass covers 2 VL of the panel's 32 outputs; the weights loaded once for all of
 * them); rows are taken in blocks small enough for the cache, and a block's panels are split
 * among OpenMP threads. A decode step's few rows thus stream every weight once at memory
 * speed, where general GEMMs spend their time on packing and edge cases. While a panel's
 * groups of rows run, each fetches its share of the next panel into L2, so the next panel's
 * first group does not wait on memory (when the last group alone fetched it, a pass ran
 * 11-19% slower at 33-64 rows and 3-4% at 512 on a host of 12 GB/s a core:
 * benchmarks/results/linear_cpu.md).
 *
 * linear_silu_mul_f32 takes an MLP's gate and up projections on one weight (gate outputs,
 * then up outputs) and pairs gate panel p with up panel p + n / 32: each row group's 32 gate
 * results wait in L1 while the 32 up results accumulate, and only silu(gate) * up is stored,
 * which saves writing and rereading the (rows, 2n) projection.
 */
#include <stddef.h>

#include "kernels.h"
#include "panel.h"

#if VREGS == 32
#define GROUP 14  /* 28 accumulators, 2 weights, 1 input */
#else
#define GROUP 6  /* 12 accumulators, 2 weights, 1 input: AVX2 and SSE have 16 registers */
#endif
#define BLOCK_BYTES (512 * 1024)  /* rows of x per block: about this much of them */

/* Which panels a group fetches into L2 while it works: `share` groups split a panel of
 * (k, 32), group `part` taking rows part * k / share .. (part + 1) * k / share. */
typedef struct {
    const float *gate_ahead;
    int64_t gate_share, gate_part;
    const float *up_ahead;
    int64_t up_share, up_part;
} prefetch_plan;

/* acc[m] += rows x the panel's outputs c .. c + SPAN over all k inputs: `mr` is a constant in
 * every call, so the loops unroll. Part `part` of `share` of the panel `ahead` (k, 32) is
 * fetched into L2 on the way, so that a panel's groups together fetch the next one. */
static inline __attribute__((always_inline)) void
panel_loop(int mr, vf acc[][2], const float *x, int64_t x_stride, const float *panel, int c,
           int64_t k, const float *ahead, int64_t share, int64_t part)
{
    const float *a = ahead + part * k / share * PANEL;  /* a row every `share` inputs */
    for (int64_t i = 0, turn = 0; i < k; i++) {
        const vf w0 = loadv(panel + i * PANEL + c), w1 = loadv(panel + i * PANEL + c + VL);
        __builtin_prefetch(panel + (i + 16) * PANEL);
        __builtin_prefetch(panel + (i + 16) * PANEL + 16);
        __builtin_prefetch(a, 0, 2);
        __builtin_prefetch(a + 16, 0, 2);
        if (++turn == share) {
            turn = 0;
            a += PANEL;
        }
        panel_step(mr, acc, x, x_stride, i, w0, w1);
    }
}

/* rows x 32 outputs of one panel (the first `cols` of them stored), SPAN at a time. */
static inline __attribute__((always_inline)) void
panel_rows(int mr, const float *x, int64_t x_stride, const float *panel, int64_t k,
           const float *bias, float *out, int64_t out_stride, int64_t cols, const float *ahead,
           int64_t share, int64_t part)
{
    vf acc[GROUP][2];  /* 28 of 32 vector registers, or 12 of 16 */
    for (int c = 0; c < PANEL; c += SPAN) {  /* a constant count: c is known in each pass */
        if (c >= cols) break;
        panel_start(mr, acc, bias ? bias + c : NULL);
        panel_loop(mr, acc, x, x_stride, panel, c, k, ahead, share, part);
        panel_store(mr, acc, out + c, out_stride, cols - c < SPAN ? cols - c : SPAN);
    }
}

/* rows x 32 outputs of silu(gate) * up: the gate panel's results wait in L1 while the up
 * panel's accumulate, and only their product is stored. The gate pass fetches `gate_ahead`,
 * the up pass `up_ahead` (parts of them, as panel_loop's `share` and `part` say). */
static inline __attribute__((always_inline)) void
pair_rows(int mr, const float *x, int64_t x_stride, const float *gate, const float *up,
          int64_t k, float *out, int64_t out_stride, const prefetch_plan *plan)
{
    float g[GROUP * PANEL] __attribute__((aligned(64)));
    panel_rows(mr, x, x_stride, gate, k, NULL, g, PANEL, PANEL, plan->gate_ahead,
               plan->gate_share, plan->gate_part);
    vf acc[GROUP][2];
    for (int c = 0; c < PANEL; c += SPAN) {
        panel_start(mr, acc, NULL);
        panel_loop(mr, acc, x, x_stride, up, c, k, plan->up_ahead, plan->up_share,
                   plan->up_part);
        for (int m = 0; m < mr; m++)
            for (int half = 0; half < 2; half++)
                storev(out + m * out_stride + c + VL * half,
                       silu_mulv(loadv(g + m * PANEL + c + VL * half), acc[m][half]));
    }
}

#if GROUP == 14
#define CASES_7_TO_14 CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14)
#else
#define CASES_7_TO_14
#endif

static void panel_group(int64_t mr, const float *x, int64_t x_stride, const float *panel,
                        int64_t k, const float *bias, float *out, int64_t out_stride,
                        int64_t cols, const float *ahead, int64_t share, int64_t part)
{
    switch (mr) {
#define CASE(m) case m:                                                                     \
        panel_rows(m, x, x_stride, panel, k, bias, out, out_stride, cols, ahead, share, part);  \
        break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASES_7_TO_14
#undef CASE
    }
}

static void pair_group(int64_t mr, const float *x, int64_t x_stride, const float *gate,
                       const float *up, int64_t k, float *out, int64_t out_stride,
                       const prefetch_plan *plan)
{
    switch (mr) {
#define CASE(m) case m: pair_rows(m, x, x_stride, gate, up, k, out, out_stride, plan); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASES_7_TO_14
#undef CASE
    }
}

/* The panels' products for rows r0 .. r1: y = x W^T (+ b) when `pairs` is 0; else out =
 * silu(gate) * up for the first `pairs` panels (gate) and the `pairs` after them (up). */
static void panels_for_rows(const float *x, int64_t x_stride, int64_t r0, int64_t r1,
                            const float *panels, int64_t n, int64_t k, const float *bias,
                            int64_t pairs, float *out, int64_t out_stride)
{
    const int64_t num_panels = pairs ? pairs : (n + PANEL - 1) / PANEL;
    #pragma omp for schedule(guided)
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
        float padded_bias[PANEL];
        const float *b = panel_bias(bias, c0, cols, padded_bias);
        /* groups of even size (32 rows in groups of 14: 11 + 11 + 10, not 14 + 14 + 4) */
        const int64_t groups = (r1 - r0 + GROUP - 1) / GROUP;
        /* the panel after this one, most often this thread's next */
        const int64_t next = p + 1 < num_panels ? p + 1 : p;
        /* the panel (of a pair: the gate panel), and the next one; a pair's up panels */
        const float *panel = panels + p * k * PANEL, *next_panel = panels + next * k * PANEL;
        const float *up = panels + (p + pairs) * k * PANEL;
        const float *next_up = panels + (next + pairs) * k * PANEL;
        for (int64_t g = 0, r = r0; g < groups; g++) {
            const int64_t mr = (r1 - r) / (groups - g);
            if (pairs) {
                /* the first gate pass fetches this pair's up panel; the other passes share
                 * the next pair's two panels (one group: its up pass fetches the next gate) */
                const prefetch_plan plan = groups == 1
                    ? (prefetch_plan){up, 1, 0, next_panel, 1, 0}
                    : (prefetch_plan){g ? next_panel : up, g ? groups - 1 : 1, g ? g - 1 : 0,
                                      next_up, groups, g};
                pair_group(mr, x + r * x_stride, x_stride, panel, up, k,
                           out + r * out_stride + c0, out_stride, &plan);
            } else
                panel_group(mr, x + r * x_stride, x_stride, panel, k, b,
                            out + r * out_stride + c0, out_stride, cols, next_panel, groups, g);
            r += mr;
        }
    }
}

static void run_panels(const float *x, int64_t x_stride, int64_t rows, const float *panels,
                       int64_t n, int64_t k, const float *bias, int64_t pairs, float *out,
                       int64_t out_stride, int num_threads)
{
    int64_t block = BLOCK_BYTES / (4 * k) / GROUP * GROUP;
    if (block < GROUP) block = GROUP;
    #pragma omp parallel num_threads(num_threads)
    for (int64_t r0 = 0; r0 < rows; r0 += block)
        panels_for_rows(x, x_stride, r0, r0 + block < rows ? r0 + block : rows, panels, n, k,
                        bias, pairs, out, out_stride);
}

void linear_f32(const float *x, int64_t x_stride, int64_t rows, const float *panels, int64_t n,
                int64_t k, const float *bias, float *out, int64_t out_stride, int num_threads)
{
    run_panels(x, x_stride, rows, panels, n, k, bias, 0, out, out_stride, num_threads);
}

int linear_silu_mul_f32(const float *x, int64_t x_stride, int64_t rows, const float *panels,
                        int64_t n, int64_t k, float *out, int64_t out_stride, int num_threads)
{
    if (n < PANEL || n % PANEL) return -1;
    run_panels(x, x_stride, rows, panels, n, k, NULL, n / PANEL, out, out_stride, num_threads);
    return 0;
}
