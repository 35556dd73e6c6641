/* Decode attention over the paged KV cache, float32, for CPUs.
 *
 * One work item per (decode sequence, KV head): its G = h / kvh query heads read each of the
 * sequence's keys and values once, straight from the cache blocks (no gathered copy, no index
 * tensors). Two passes per item: the scaled scores of every head into a scratch row, then a
 * softmax and the probability-weighted sum of the values. Items are shared among OpenMP
 * threads (the same libgomp as torch's: it is loaded first, under the same soname).
 *
 * Layouts (float32, contiguous unless a stride is given):
 *   q       row r of the batch at q + r * q_stride, its h heads of d values contiguous
 *   kc, vc  (num_blocks, block_size, kvh, d)
 *   tables  (B, max_blocks) int64; lens (B,) int64; rows (B,) int64: each decode's batch row
 *   out     (T, h, d): decode b writes row rows[b]
 * Returns 0; -1 for an unsupported head size; -2 when scratch memory could not be had;
 * -(3 + b) when decode b's length or block table does not fit the cache (checked first:
 * nothing is read out of bounds).
 */
#include <stdlib.h>

#include "kernels.h"
#include "vec16.h"

/* Softmax of s[0..L) in place; returns 1 / (sum of exponentials). */
static float softmax_row(float *s, int64_t L)
{
    float m = s[0];
    int64_t t = 0;
    if (L >= 16) {
        v16 mv = load16(s);
        for (t = 16; t + 16 <= L; t += 16) mv = vmax(load16(s + t), mv);
        m = hmax(mv);
    }
    for (; t < L; t++) m = s[t] > m ? s[t] : m;
    v16 sums = SPLAT(0.f);
    for (t = 0; t + 16 <= L; t += 16) {
        const v16 e = exp16_nonpos(load16(s + t) - SPLAT(m));
        store16(s + t, e);
        sums += e;
    }
    float sum = hsum(sums);
    if (t < L) {
        v16 x = SPLAT(-87.0f);
        for (int64_t i = t; i < L; i++) x[i - t] = s[i] - m;
        const v16 e = exp16_nonpos(x);
        for (int64_t i = t; i < L; i++) { s[i] = e[i - t]; sum += e[i - t]; }
    }
    return 1.f / sum;
}

/* The first row of one KV head in the block holding token t0 (a block's first token). */
static inline const float *block_rows(const float *cache, const int64_t *table, int64_t t0,
                                      int64_t bs, int64_t row_stride)
{
    return cache + table[t0 / bs] * bs * row_stride;
}

/* While row o of a block is worked on, ask for row o of the next block (blocks lie anywhere in
 * the cache, where the hardware prefetcher does not follow; one row at a time keeps the
 * requests spread out rather than queued at the block's start). */
#define PREFETCH_ROW(next, o, row_stride, C)                                                 \
    for (int c = 0; c < (C); c++) __builtin_prefetch((next) + (o) * (row_stride) + 16 * c)

/* One (sequence, KV head): q (G, D) -> out (G, D); scores: G * L floats of scratch. */
#define DEFINE_ATTEND(D)                                                                    \
static void attend_##D(const float *q, const float *kc, const float *vc,                     \
                       const int64_t *table, int64_t L, int64_t G, int64_t row_stride,       \
                       int64_t bs, float scale, float *scores, float *out)                   \
{                                                                                            \
    enum { C = D / 16 };                                                                     \
    for (int64_t j = 0; j < G; j++) {                                                        \
        v16 qj[C];                                                                           \
        for (int c = 0; c < C; c++) qj[c] = load16(q + j * D + 16 * c) * SPLAT(scale);      \
        float *s = scores + j * L;                                                           \
        for (int64_t t0 = 0; t0 < L; t0 += bs) {                                             \
            const float *kb = block_rows(kc, table, t0, bs, row_stride);                     \
            const float *kn = t0 + bs < L ? block_rows(kc, table, t0 + bs, bs, row_stride) : kb; \
            const int64_t n = L - t0 < bs ? L - t0 : bs;                                     \
            for (int64_t o = 0; o < n; o++) {                                                \
                PREFETCH_ROW(kn, o, row_stride, C);                                          \
                const float *k = kb + o * row_stride;                                        \
                v16 acc = qj[0] * load16(k);                                                 \
                for (int c = 1; c < C; c++) acc += qj[c] * load16(k + 16 * c);               \
                s[t0 + o] = hsum(acc);                                                       \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (int64_t j = 0; j < G; j++) {                                                        \
        const float *s = scores + j * L;                                                     \
        const float inv = softmax_row(scores + j * L, L);                                    \
        v16 acc[C];                                                                          \
        for (int c = 0; c < C; c++) acc[c] = SPLAT(0.f);                                     \
        for (int64_t t0 = 0; t0 < L; t0 += bs) {                                             \
            const float *vb = block_rows(vc, table, t0, bs, row_stride);                     \
            const float *vn = t0 + bs < L ? block_rows(vc, table, t0 + bs, bs, row_stride) : vb; \
            const int64_t n = L - t0 < bs ? L - t0 : bs;                                     \
            for (int64_t o = 0; o < n; o++) {                                                \
                PREFETCH_ROW(vn, o, row_stride, C);                                          \
                const v16 p = SPLAT(s[t0 + o]);                                              \
                const float *v = vb + o * row_stride;                                        \
                for (int c = 0; c < C; c++) acc[c] += p * load16(v + 16 * c);                \
            }                                                                                \
        }                                                                                    \
        for (int c = 0; c < C; c++) store16(out + j * D + 16 * c, acc[c] * SPLAT(inv));     \
    }                                                                                        \
}

DEFINE_ATTEND(64)
DEFINE_ATTEND(128)

static int64_t check_decodes(const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                             int64_t B, int64_t bs, int64_t num_blocks)
{
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] < 1 || lens[b] > max_blocks * bs) return b;
        for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; i++) {
            const int64_t block = tables[b * max_blocks + i];
            if (block < 0 || block >= num_blocks) return b;
        }
    }
    return -1;
}

int paged_decode_f32(const float *q, int64_t q_stride, const float *kc, const float *vc,
                     int64_t num_blocks, int64_t bs, int64_t kvh, int64_t d,
                     const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                     const int64_t *rows, int64_t B, int64_t h, float scale, float *out,
                     int num_threads)
{
    if ((d != 64 && d != 128) || h % kvh) return -1;
    const int64_t bad = check_decodes(tables, max_blocks, lens, B, bs, num_blocks);
    if (bad >= 0) return (int)(-3 - bad);
    const int64_t G = h / kvh, row_stride = kvh * d;
    int out_of_memory = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = NULL;
        int64_t capacity = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * kvh; item++) {
            const int64_t b = item / kvh, g = item % kvh, L = lens[b];
            if (L * G > capacity) {
                free(scores);
                capacity = L * G;
                scores = malloc(sizeof(float) * capacity);
                if (!scores) {
                    capacity = 0;
                    #pragma omp atomic write
                    out_of_memory = 1;
                    continue;
                }
            }
            const float *qb = q + rows[b] * q_stride + g * G * d;
            float *ob = out + (rows[b] * h + g * G) * d;
            const int64_t *table = tables + b * max_blocks;
            if (d == 64)
                attend_64(qb, kc + g * d, vc + g * d, table, L, G, row_stride, bs, scale,
                          scores, ob);
            else
                attend_128(qb, kc + g * d, vc + g * d, table, L, G, row_stride, bs, scale,
                           scores, ob);
        }
        free(scores);
    }
    return out_of_memory ? -2 : 0;
}
