/* A Llama-style decoder's layers in one call, float32: the same kernels, in the same order, as
 * the per-layer modules of models/llama.py call one by one from Python, so the results are
 * the same bit for bit. What it saves is the interpreter between the kernels: about ten calls
 * per layer, each with its checks and allocations, while the other OpenMP threads wait.
 *
 * Per layer, for the step's T tokens (x: (T, H), the residual stream, updated in place):
 *   normed = rms_norm(x)                     qkv = normed W_qkv (+ b)      (T, (h + 2 kvh) d)
 *   rotary on q and k (in place)             k, v -> their cache slots
 *   attn = paged attention (decodes, then each prefill span)              (T, h d)
 *   x += attn W_o, normed = rms_norm(x)      x += down(silu(gate) * up)
 * (silu(gate) * up in one pass with the gate/up projection where the float32 panels serve).
 * The caches of all layers are one array (layers, 2, blocks, block_size, kvh, d).
 *
 * Where the step names its output rows (the tokens whose final states it samples or pools),
 * the last layer computes only what those rows need: every token's keys and values still go
 * to the cache, but a prefill span's attention starts at its first output row (none at all
 * for a span without one), and the output projection and MLP run on the output rows alone,
 * moved to x's first rows. Each row's arithmetic is the same as in the full layer (the
 * kernels' rows are independent of each other), so those rows' results are the same bit for
 * bit; the work skipped is most of a layer for every prompt token but the last.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_layers.h"
#include "kernels.h"

static void add_in_place(float *x, const float *y, int64_t count, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) if (count >= PARALLEL_MIN_VALUES)
    for (int64_t i = 0; i < count; i++) x[i] += y[i];
}

/* Keys and values of the step's tokens into their slots: (T, kvh d) rows of qkv at column
 * h d (keys) and (h + kvh) d (values). */
static void write_kv(const float *qkv, int64_t qkv_stride, int64_t T, const int64_t *slots,
                     int64_t k_offset, int64_t kv_width, float *kc, float *vc)
{
    for (int64_t t = 0; t < T; t++) {
        const float *k = qkv + t * qkv_stride + k_offset, *v = k + kv_width;
        float *kd = kc + slots[t] * kv_width, *vd = vc + slots[t] * kv_width;
        for (int64_t i = 0; i < kv_width; i++) { kd[i] = k[i]; vd[i] = v[i]; }
    }
}

/* Whether T rows run on a weight's codes (it has them, and the rows are few) or its panels. */
static int on_codes(const void *codes, int64_t T, int64_t coded_max_rows)
{
    return codes && T <= coded_max_rows;
}

/* out = x W^T (+ b) on the coded weight for a step's few rows, else on the float32 panels:
 * the same results either way (linear_coded.c). */
static void project(const float *x, int64_t T, const float *panels, const void *codes,
                    const void *params, int64_t bits, int64_t n, int64_t k, const float *bias,
                    float *out, int64_t coded_max_rows, int num_threads)
{
    if (on_codes(codes, T, coded_max_rows))
        linear_coded_f32(x, k, T, codes, params, (int)bits, n, k, bias, out, n, num_threads);
    else
        linear_f32(x, k, T, panels, n, k, bias, out, n, num_threads);
}

/* Rows rows[0 .. R - 1] (strictly increasing) of a (T, width) array moved to its first R. */
static void keep_rows(float *a, int64_t width, const int64_t *rows, int64_t R)
{
    for (int64_t i = 0; i < R; i++)
        if (rows[i] != i) memcpy(a + i * width, a + rows[i] * width, sizeof(float) * width);
}

/* The first output row in start .. end - 1, or end when there is none. */
static int64_t first_output(const step_batch *b, int64_t start, int64_t end)
{
    for (int64_t i = 0; i < b->num_outputs; i++)
        if (b->output_rows[i] >= start) return b->output_rows[i] < end ? b->output_rows[i] : end;
    return end;
}

static float *scratch_alloc(int64_t floats)
{
    return aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
}

int decoder_check_step(int64_t T, const decoder_shape *s, int64_t num_blocks, int64_t bs,
                       const step_batch *b)
{
    const int64_t h = s->heads, kvh = s->kv_heads, d = s->head_dim;
    if ((d != 64 && d != 128) || kvh < 1 || h % kvh || bs < 1 || T < 1) return DL_UNSUPPORTED;
    for (int64_t t = 0; t < T; t++)
        if (b->slots[t] < 0 || b->slots[t] >= num_blocks * bs) return DL_BAD_SLOT;
    for (int64_t i = 0; i < b->num_decodes; i++)  /* the kernels check tables and lengths */
        if (b->decode_rows[i] < 0 || b->decode_rows[i] >= T) return DL_BAD_DECODE;
    for (int64_t p = 0; p < b->num_prefills; p++)
        if (b->prefill_start[p] < 0 || b->prefill_end[p] > T
                || b->prefill_table_lens[p] > b->prefill_max_blocks) return DL_BAD_PREFILL;
    for (int64_t i = 0; b->output_rows && i < b->num_outputs; i++)
        if (b->output_rows[i] < (i ? b->output_rows[i - 1] + 1 : 0) || b->output_rows[i] >= T)
            return DL_BAD_OUTPUT;
    return 0;
}

int decoder_layers_f32(float *x, int64_t T, const decoder_shape *s, const layer_weights *layers,
                       float *kv, int64_t num_blocks, int64_t bs, const float *cos,
                       const float *sin, const step_batch *b, int num_threads)
{
    const int64_t H = s->hidden, h = s->heads, kvh = s->kv_heads, d = s->head_dim;
    const int64_t I = s->intermediate, Q = (h + 2 * kvh) * d, kv_width = kvh * d;
    const int64_t coded = s->coded_max_rows;
    const int bad = decoder_check_step(T, s, num_blocks, bs, b);
    if (bad) return bad;
    float *normed = scratch_alloc(T * H), *qkv = scratch_alloc(T * Q);
    float *attn = scratch_alloc(T * h * d), *tmp = scratch_alloc(T * H);
    float *gu = scratch_alloc(T * 2 * I), *act = scratch_alloc(T * I);
    int code = 0;
    if (!normed || !qkv || !attn || !tmp || !gu || !act) code = DL_NO_MEMORY;
    const int64_t cache = num_blocks * bs * kv_width;  /* floats of one layer's K (or V) */
    for (int64_t l = 0; l < s->layers && !code; l++) {
        const layer_weights *w = layers + l;
        const int prune = l == s->layers - 1 && b->output_rows && b->num_outputs < T;
        float *kc = kv + 2 * l * cache, *vc = kc + cache;
        rms_norm_f32(x, H, w->input_norm, normed, H, T, H, s->eps, num_threads);
        project(normed, T, w->qkv, w->qkv_codes, w->qkv_params, w->qkv_bits, Q, H, w->qkv_bias,
                qkv, coded, num_threads);
        rotary_f32(qkv, Q, T, h + kvh, d, cos, sin, num_threads);
        write_kv(qkv, Q, T, b->slots, h * d, kv_width, kc, vc);
        if (b->num_decodes) {
            const int r = paged_decode_f32(qkv, Q, kc, vc, num_blocks, bs, kvh, d,
                                           b->decode_tables, b->decode_max_blocks,
                                           b->decode_lens, b->decode_rows, b->num_decodes, h,
                                           s->scale, attn, num_threads);
            if (r == -2) code = DL_NO_MEMORY;
            else if (r < 0) code = DL_BAD_DECODE;
        }
        for (int64_t p = 0; p < b->num_prefills && !code; p++) {
            const int64_t end = b->prefill_end[p];
            const int64_t start = prune ? first_output(b, b->prefill_start[p], end)
                                        : b->prefill_start[p];
            if (start == end) continue;  /* the last layer, no output row in this span */
            const int r = paged_prefill_f32(qkv + start * Q, Q, kc, vc, num_blocks, bs, kvh, d,
                                            b->prefill_tables + p * b->prefill_max_blocks,
                                            b->prefill_table_lens[p], end - start,
                                            b->prefill_context[p], h, s->scale,
                                            attn + start * h * d, h * d, num_threads);
            if (r == -2) code = DL_NO_MEMORY;
            else if (r < 0) code = DL_BAD_PREFILL;
        }
        if (code) break;
        int64_t rows = T;
        if (prune) {
            rows = b->num_outputs;
            keep_rows(x, H, b->output_rows, rows);
            keep_rows(attn, h * d, b->output_rows, rows);
            if (!rows) break;
        }
        project(attn, rows, w->o, w->o_codes, w->o_params, w->o_bits, H, h * d, NULL, tmp, coded,
                num_threads);
        add_rms_norm_f32(x, H, tmp, H, w->post_norm, normed, H, rows, H, s->eps, num_threads);
        /* on the panels in one pass, where they serve and the width allows */
        if (on_codes(w->gate_up_codes, rows, coded)
                || linear_silu_mul_f32(normed, H, rows, w->gate_up, I, H, act, I, num_threads)) {
            project(normed, rows, w->gate_up, w->gate_up_codes, w->gate_up_params,
                    w->gate_up_bits, 2 * I, H, NULL, gu, coded, num_threads);
            silu_mul_f32(gu, 2 * I, act, I, rows, I, num_threads);
        }
        project(act, rows, w->down, w->down_codes, w->down_params, w->down_bits, H, I, NULL, tmp,
                coded, num_threads);
        add_in_place(x, tmp, rows * H, num_threads);
    }
    free(normed); free(qkv); free(attn); free(tmp); free(gu); free(act);
    return code;
}
