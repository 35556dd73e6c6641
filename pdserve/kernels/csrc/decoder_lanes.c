/* A step of decodes alone, run in lanes: the step's rows split into consecutive groups, and
 * each group goes through every layer on one thread of its own (decoder_layers_f32 with one
 * thread), with no barrier between the lanes until the step's end.
 *
 * The step-wide loop shares every projection and every attention between the threads, so a
 * decode step of 30 layers passes about 150 barriers. When another thread of the machine (a
 * server streaming tokens, the router relaying them) preempts one compute thread, its partner
 * soon sleeps at the next barrier and its core idles until it is woken: a decode-only step
 * served beside its streams idled 10% of the cores against 2-4% for steps with prompt chunks
 * (benchmarks/results/disagg_vs_colocated.md). A lane that is preempted delays only itself.
 * Each lane streams every weight, so lanes only pay with enough rows per lane
 * (kernels/cpu_layers.py chooses). A row's arithmetic does not depend on the other rows of
 * its step or on the thread count, so the results are the same bit for bit.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "decoder_layers.h"

int decoder_lanes_f32(float *x, int64_t T, const decoder_shape *s, const layer_weights *layers,
                      float *kv, int64_t num_blocks, int64_t bs, const float *cos,
                      const float *sin, const step_batch *b, const int64_t *bounds,
                      int64_t num_lanes)
{
    if (num_lanes < 1 || T < 1 || b->num_prefills || b->num_decodes != T || b->output_rows
            || bounds[0] != 0 || bounds[num_lanes] != T)
        return DL_UNSUPPORTED;
    for (int64_t i = 0; i < num_lanes; i++)
        if (bounds[i + 1] <= bounds[i]) return DL_UNSUPPORTED;
    /* the whole step, as the step-wide loop checks it before it writes anything */
    const int bad = decoder_check_step(T, s, num_blocks, bs, b);
    if (bad) return bad;
    for (int64_t t = 0; t < T; t++)
        if (b->decode_rows[t] != t) return DL_BAD_DECODE;
    int64_t *row_ids = malloc(sizeof(int64_t) * T);
    step_batch *lanes = malloc(sizeof(step_batch) * num_lanes);
    int *codes = malloc(sizeof(int) * num_lanes);
    if (!row_ids || !lanes || !codes) {
        free(row_ids); free(lanes); free(codes);
        return DL_NO_MEMORY;
    }
    for (int64_t t = 0; t < T; t++) row_ids[t] = t;
    for (int64_t i = 0; i < num_lanes; i++) {
        const int64_t start = bounds[i];
        lanes[i] = *b;
        lanes[i].slots = b->slots + start;
        lanes[i].num_decodes = bounds[i + 1] - start;
        lanes[i].decode_rows = row_ids;
        lanes[i].decode_lens = b->decode_lens + start;
        lanes[i].decode_tables = b->decode_tables + start * b->decode_max_blocks;
    }
    const int64_t H = s->hidden, half = s->head_dim / 2;
    #pragma omp parallel num_threads((int)num_lanes)
    for (int64_t i = omp_get_thread_num(); i < num_lanes; i += omp_get_num_threads()) {
        const int64_t start = bounds[i];
        codes[i] = decoder_layers_f32(x + start * H, bounds[i + 1] - start, s, layers, kv,
                                      num_blocks, bs, cos + start * half, sin + start * half,
                                      lanes + i, 1);
    }
    int code = 0;
    for (int64_t i = 0; i < num_lanes && !code; i++) code = codes[i];
    free(row_ids); free(lanes); free(codes);
    return code;
}
