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
#include "vec.h"

/* Softmax of s[0..L) in place; returns 1 / (sum of exponentials). */
static float softmax_row(float *s, int64_t L)
{
    float m = s[0];
    int64_t t = 0;
    if (L >= VL) {
        vf mv = loadv(s);
        for (t = VL; t + VL <= L; t += VL) mv = vmax(loadv(s + t), mv);
        m = hmax(mv);
    }
    for (; t < L; t++) m = s[t] > m ? s[t] : m;
    vf sums = SPLAT(0.f);
    for (t = 0; t + VL <= L; t += VL) {
        const vf e = expv_nonpos(loadv(s + t) - SPLAT(m));
        storev(s + t, e);
        sums += e;
    }
    float sum = hsum(sums);
    if (t < L) {
        vf x = SPLAT(-87.0f);
        for (int64_t i = t; i < L; i++) x[i - t] = s[i] - m;
        const vf e = expv_nonpos(x);
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

/* Blocks lie anywhere in the cache, where the hardware prefetcher does not follow them, so a
 * walk asks for the blocks ahead itself, into L2: while row o of a block is worked on, row o
 * of the block AHEAD_BLOCKS on (one row at a time keeps the requests spread out rather than
 * queued at a block's start), and the blocks in between all at once when the walk begins.
 * Asking for the next block only, into L1, left the reads at half the memory's streaming rate
 * (benchmarks/results/decode_attention.md). */
#define AHEAD_BLOCKS 3
#define PREFETCH_ROW(ahead, o, row_stride, lines)  /* its 64-byte lines */                   \
    for (int c = 0; c < (lines); c++)                                                        \
        __builtin_prefetch((ahead) + (o) * (row_stride) + 16 * c, 0, 2)

/* The rows of the block AHEAD_BLOCKS after the one holding token t0, or NULL past the end. */
static inline const float *block_ahead(const float *cache, const int64_t *table, int64_t t0,
                                       int64_t L, int64_t bs, int64_t row_stride)
{
    const int64_t t = t0 + AHEAD_BLOCKS * bs;
    return t < L ? block_rows(cache, table, t, bs, row_stride) : NULL;
}

/* The first rows a walk reads after its first block: blocks 1 .. AHEAD_BLOCKS - 1. */
static void prefetch_walk_start(const float *cache, const int64_t *table, int64_t L,
                                int64_t bs, int64_t row_stride, int lines)
{
    for (int64_t t0 = bs; t0 < L && t0 < AHEAD_BLOCKS * bs; t0 += bs) {
        const float *rows = block_rows(cache, table, t0, bs, row_stride);
        for (int64_t o = 0; o < bs && t0 + o < L; o++) PREFETCH_ROW(rows, o, row_stride, lines);
    }
}

/* One (sequence, KV head): q (G, D) -> out (G, D); scores: G * L floats of scratch. The query
 * heads go in groups of S = 16 VL / D (4 heads of 64 or 2 of 128 with 16 lanes: their
 * queries, or their sums, fill 16 of the 32 registers; half as many heads with AVX2's 8
 * lanes, whose 16 registers they fill, the rest spilling to L1; one head with 4 lanes), and
 * each group walks the keys, then the values, once: a row read from memory serves all the
 * group's heads at once, where one head at a time put passes over cached rows between the
 * reads. Each head's sums still run over the keys in order: the results are the same, bit for
 * bit. */
#define DEFINE_ATTEND(D)                                                                     \
static void attend_##D(const float *q, const float *kc, const float *vc,                     \
                       const int64_t *table, int64_t L, int64_t G, int64_t row_stride,       \
                       int64_t bs, float scale, float *scores, float *out)                   \
{                                                                                            \
    enum { C = D / VL, S = 16 * VL / D ? 16 * VL / D : 1, LINES = D / 16 };                  \
    for (int64_t j0 = 0; j0 < G; j0 += S) {                                                  \
        const int n_heads = G - j0 < S ? (int)(G - j0) : S;                                  \
        vf qj[S][C];                                                                         \
        for (int j = 0; j < S; j++)                                                          \
            for (int c = 0; c < C; c++)                                                      \
                qj[j][c] = j < n_heads ? loadv(q + (j0 + j) * D + VL * c) * SPLAT(scale)     \
                                       : SPLAT(0.f);                                         \
        float *s = scores + j0 * L;                                                          \
        prefetch_walk_start(kc, table, L, bs, row_stride, LINES);                            \
        for (int64_t t0 = 0; t0 < L; t0 += bs) {                                             \
            const float *kb = block_rows(kc, table, t0, bs, row_stride);                     \
            const float *ka = block_ahead(kc, table, t0, L, bs, row_stride);                 \
            const int64_t n = L - t0 < bs ? L - t0 : bs;                                     \
            for (int64_t o = 0; o < n; o++) {                                                \
                if (ka) PREFETCH_ROW(ka, o, row_stride, LINES);                              \
                const float *k = kb + o * row_stride;                                        \
                vf kr[C];                                                                    \
                for (int c = 0; c < C; c++) kr[c] = loadv(k + VL * c);                       \
                for (int j = 0; j < n_heads; j++) {                                          \
                    vf acc = qj[j][0] * kr[0];                                               \
                    for (int c = 1; c < C; c++) acc += qj[j][c] * kr[c];                     \
                    s[j * L + t0 + o] = hsum(acc);                                           \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        float inv[S];                                                                        \
        vf acc[S][C];                                                                        \
        for (int j = 0; j < S; j++) {                                                        \
            inv[j] = j < n_heads ? softmax_row(s + j * L, L) : 0.f;                          \
            for (int c = 0; c < C; c++) acc[j][c] = SPLAT(0.f);                              \
        }                                                                                    \
        prefetch_walk_start(vc, table, L, bs, row_stride, LINES);                            \
        for (int64_t t0 = 0; t0 < L; t0 += bs) {                                             \
            const float *vb = block_rows(vc, table, t0, bs, row_stride);                     \
            const float *va = block_ahead(vc, table, t0, L, bs, row_stride);                 \
            const int64_t n = L - t0 < bs ? L - t0 : bs;                                     \
            for (int64_t o = 0; o < n; o++) {                                                \
                if (va) PREFETCH_ROW(va, o, row_stride, LINES);                              \
                const float *v = vb + o * row_stride;                                        \
                vf vr[C];                                                                    \
                for (int c = 0; c < C; c++) vr[c] = loadv(v + VL * c);                       \
                for (int j = 0; j < n_heads; j++) {                                          \
                    const vf p = SPLAT(s[j * L + t0 + o]);                                   \
                    for (int c = 0; c < C; c++) acc[j][c] += p * vr[c];                      \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int j = 0; j < n_heads; j++)                                                    \
            for (int c = 0; c < C; c++)                                                      \
                storev(out + (j0 + j) * D + VL * c, acc[j][c] * SPLAT(inv[j]));              \
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
    /* Runs: a decode whose row, length and first block follow the one before it is a draft
     * after it (engine/ngram_drafts.py). One item takes a whole run of one KV head, so the
     * run's later rows walk keys and values the first just brought into this core's cache.
     * Each decode is still computed on its own, so the grouping changes no result. */
    int64_t *run_start = malloc(sizeof(int64_t) * (B + 1));
    if (!run_start) return -2;
    int64_t runs = 0;
    for (int64_t b = 0; b < B; b++)
        if (!b || rows[b] != rows[b - 1] + 1 || lens[b] != lens[b - 1] + 1
                || tables[b * max_blocks] != tables[(b - 1) * max_blocks])
            run_start[runs++] = b;
    run_start[runs] = B;
    int out_of_memory = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = NULL;
        int64_t capacity = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < runs * kvh; item++) {
            const int64_t r = item / kvh, g = item % kvh;
            for (int64_t b = run_start[r]; b < run_start[r + 1]; b++) {
                const int64_t L = lens[b];
                if (L * G > capacity) {
                    free(scores);
                    capacity = L * G;
                    scores = malloc(sizeof(float) * capacity);
                    if (!scores) {
                        capacity = 0;
                        #pragma omp atomic write
                        out_of_memory = 1;
                        break;
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
        }
        free(scores);
    }
    free(run_start);
    return out_of_memory ? -2 : 0;
}
