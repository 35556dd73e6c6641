/* Prefill attention over the paged KV cache, float32, for CPUs: flash-style, register-tiled.
 *
 * One sequence's n new tokens attend causally over its context of L tokens, the new ones last
 * and already written to the cache: query i (position L - n + i) sees keys 0 .. L - n + i.
 * A work item is one KV head and a tile of up to QUERY_TILE query tokens (fewer when that
 * would leave a thread without several items); its rows are the (token, query head) pairs
 * that share that KV head. First every KV head's keys are copied out of the cache blocks once
 * per call, transposed, in tiles of KEY_TILE (values are read where they lie). An item then
 * walks the key tiles its rows can see. For each group of ROW_GROUP rows, it computes the
 * group's scores in registers (one broadcast query element times four vectors of keys per
 * step), updates each row's running maximum and sum (online softmax, each step for all the
 * group's rows at once), and adds the probability-weighted values to the rows' accumulators,
 * four vectors of columns at a time, again in registers. No score matrix is built, and key
 * tiles a row cannot see are skipped.
 *
 * Layouts (float32): q row i at q + i * q_stride (h heads of d values contiguous); kc, vc
 * (num_blocks, block_size, kvh, d) contiguous; table: the sequence's blocks (table_len of
 * them); out row i at out + i * out_stride. Returns 0; -1 for an unsupported shape; -2 when
 * scratch memory could not be had; -3 when n, L or the table do not fit the cache (checked
 * first: nothing is read out of bounds).
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

#define QUERY_TILE 64  /* query tokens per work item, at most */
#define MIN_QUERY_TILE 8
#define KEY_TILE (4 * VL)     /* keys per tile: four vectors of scores per row */
#define VALUE_SPAN (4 * VL)   /* output columns a row accumulates at a time: four vectors */
#if VREGS == 32
#define ROW_GROUP 6  /* rows whose scores (6 x 4 vectors) stay in registers together */
#else
#define ROW_GROUP 3  /* 16 registers: 12 scores and 4 keys, the query from memory */
#endif

static const vf LANES = LANE_INDICES;

/* One thread's scratch: rows = QUERY_TILE * G at most. */
typedef struct {
    float *qs;  /* (rows, D) the item's queries, scaled */
    float *o;   /* (rows, D) unnormalised outputs */
    float *m;   /* (rows,) running maximum score */
    float *l;   /* (rows,) running sum of exponentials */
    float *p;   /* (ROW_GROUP, KEY_TILE) one group's probabilities */
} scratch;

/* Copy keys k0 .. k0 + nk - 1 of one KV head (at kc + at[t]) into kt (D, KEY_TILE),
 * transposed, the tile's tail zeroed. */
static void pack_keys(const float *kc, const int64_t *at, int64_t k0, int64_t nk, int64_t d,
                      float *kt)
{
    for (int64_t j = 0; j < KEY_TILE; j++) {
        const float *k = j < nk ? kc + at[k0 + j] : NULL;
        for (int64_t e = 0; e < d; e++) kt[e * KEY_TILE + j] = k ? k[e] : 0.f;
    }
}

/* Rows r0 .. r0 + ROW_GROUP - 1 (those below `rows`) against one key tile starting at k0:
 * its keys in kt_tile (D, KEY_TILE), key j's values at vc + at[j]. Row r is token r / G of
 * the item, at position pos0 + r / G. */
static inline __attribute__((always_inline)) void
row_group(const scratch *w, const float *kt_tile, const float *vc, const int64_t *at,
          int64_t r0, int64_t rows, int64_t k0, int64_t nk, int64_t pos0, int64_t G,
          const int64_t D)
{
    const int64_t nr = rows - r0 < ROW_GROUP ? rows - r0 : ROW_GROUP;
    int64_t row[ROW_GROUP];  /* rows past the end repeat the last one and are not stored */
    for (int i = 0; i < ROW_GROUP; i++) row[i] = r0 + (i < nr ? i : nr - 1);

    vf s[ROW_GROUP][4];
    for (int i = 0; i < ROW_GROUP; i++)
        for (int c = 0; c < 4; c++) s[i][c] = SPLAT(0.f);
    for (int64_t e = 0; e < D; e++) {
        const float *kt = kt_tile + e * KEY_TILE;
        const vf k[4] = {loadv(kt), loadv(kt + VL), loadv(kt + 2 * VL), loadv(kt + 3 * VL)};
        #pragma GCC unroll 6
        for (int i = 0; i < ROW_GROUP; i++) {
            const vf qe = SPLAT(w->qs[row[i] * D + e]);
            #pragma GCC unroll 4
            for (int c = 0; c < 4; c++) s[i][c] += qe * k[c];
        }
    }

    /* Online softmax, each step for all the group's rows at once so that their dependency
     * chains (horizontal max, exponentials, horizontal sum) overlap. */
    vf m_new[ROW_GROUP], sum[ROW_GROUP];
    float alpha[ROW_GROUP];
    #pragma GCC unroll 6
    for (int i = 0; i < ROW_GROUP; i++) {
        const int64_t seen = pos0 + row[i] / G - k0 + 1;  /* keys of the tile this row sees */
        if (seen < KEY_TILE)
            for (int c = 0; c < 4; c++)
                s[i][c] = vselect(LANES + SPLAT((float)(VL * c)) >= SPLAT((float)seen),
                                  SPLAT(-INFINITY), s[i][c]);
        vf top = vmax(vmax(s[i][0], s[i][1]), vmax(s[i][2], s[i][3]));
        HALVE(top, vmax);  /* every lane: the row's maximum over the tile */
        m_new[i] = vmax(top, SPLAT(w->m[row[i]]));
    }
    #pragma GCC unroll 6
    for (int i = 0; i < ROW_GROUP; i++) {
        sum[i] = SPLAT(0.f);
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            s[i][c] = expv_nonpos(s[i][c] - m_new[i]);  /* masked keys: 0 */
            sum[i] += s[i][c];
        }
    }
    #pragma GCC unroll 6
    for (int i = 0; i < ROW_GROUP; i++) {
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) storev(w->p + i * KEY_TILE + VL * c, s[i][c]);
        HALVE(sum[i], vadd);
    }
    for (int i = 0; i < ROW_GROUP; i++) {
        const int64_t r = row[i];
        const float m_old = w->m[r], m = m_new[i][0];
        alpha[i] = m == m_old ? 1.f : expf(m_old - m);  /* the max rarely grows */
        if (i < nr) {
            w->l[r] = w->l[r] * alpha[i] + sum[i][0];
            w->m[r] = m;
        }
    }

    /* the group's last row sees the most keys */
    const int64_t seen_max = pos0 + row[ROW_GROUP - 1] / G - k0 + 1;
    const int64_t keys = seen_max < nk ? seen_max : nk;
    for (int64_t c0 = 0; c0 < D; c0 += VALUE_SPAN) {
        vf acc[ROW_GROUP][4];
        #pragma GCC unroll 6
        for (int i = 0; i < ROW_GROUP; i++)
            for (int c = 0; c < 4; c++)
                acc[i][c] = loadv(w->o + row[i] * D + c0 + VL * c) * SPLAT(alpha[i]);
        for (int64_t j = 0; j < keys; j++) {
            const float *vt = vc + at[j] + c0;
            const vf v[4] = {loadv(vt), loadv(vt + VL), loadv(vt + 2 * VL), loadv(vt + 3 * VL)};
            #pragma GCC unroll 6
            for (int i = 0; i < ROW_GROUP; i++) {
                const vf pj = SPLAT(w->p[i * KEY_TILE + j]);
                #pragma GCC unroll 4
                for (int c = 0; c < 4; c++) acc[i][c] += pj * v[c];
            }
        }
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < 4; c++) storev(w->o + row[i] * D + c0 + VL * c, acc[i][c]);
    }
}

/* Query tokens i0 .. i1 - 1 of one KV head (its G query heads): keys, that head's packed
 * key tiles; token t's values at vc + at[t]. */
static inline __attribute__((always_inline)) void
prefill_item(const float *q, int64_t q_stride, const float *keys, const float *vc,
             const int64_t *at, int64_t past, int64_t i0, int64_t i1, int64_t G, float scale,
             float *out, int64_t out_stride, const scratch *w, const int64_t D)
{
    const int64_t rows = (i1 - i0) * G;
    for (int64_t r = 0; r < rows; r++) {
        const float *src = q + (i0 + r / G) * q_stride + (r % G) * D;
        for (int64_t e = 0; e < D; e += VL) {
            storev(w->qs + r * D + e, loadv(src + e) * SPLAT(scale));
            storev(w->o + r * D + e, SPLAT(0.f));
        }
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    const int64_t last = past + i1 - 1;  /* the item's last query position */
    for (int64_t k0 = 0; k0 <= last; k0 += KEY_TILE) {
        const int64_t nk = last + 1 - k0 < KEY_TILE ? last + 1 - k0 : KEY_TILE;
        const int64_t first = k0 > past + i0 ? k0 - past - i0 : 0;  /* first token seeing k0 */
        for (int64_t r0 = first * G; r0 < rows; r0 += ROW_GROUP)
            row_group(w, keys + k0 * D, vc, at + k0, r0, rows, k0, nk, past + i0, G, D);
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + (i0 + r / G) * out_stride + (r % G) * D;
        const vf inv = SPLAT(1.f / w->l[r]);
        for (int64_t e = 0; e < D; e += VL) storev(dst + e, loadv(w->o + r * D + e) * inv);
    }
}

static void prefill_item_64(const float *q, int64_t q_stride, const float *keys, const float *vc,
                            const int64_t *at, int64_t past, int64_t i0, int64_t i1, int64_t G,
                            float scale, float *out, int64_t out_stride, const scratch *w)
{
    prefill_item(q, q_stride, keys, vc, at, past, i0, i1, G, scale, out, out_stride, w, 64);
}

static void prefill_item_128(const float *q, int64_t q_stride, const float *keys, const float *vc,
                             const int64_t *at, int64_t past, int64_t i0, int64_t i1, int64_t G,
                             float scale, float *out, int64_t out_stride, const scratch *w)
{
    prefill_item(q, q_stride, keys, vc, at, past, i0, i1, G, scale, out, out_stride, w, 128);
}

static int scratch_alloc(scratch *w, int64_t rows, int64_t d)
{
    const size_t f = sizeof(float);
    w->qs = aligned_alloc(64, f * rows * d);
    w->o = aligned_alloc(64, f * rows * d);
    w->m = malloc(f * rows);
    w->l = malloc(f * rows);
    w->p = aligned_alloc(64, f * ROW_GROUP * KEY_TILE);
    return w->qs && w->o && w->m && w->l && w->p;
}

static void scratch_free(scratch *w)
{
    free(w->qs);
    free(w->o);
    free(w->m);
    free(w->l);
    free(w->p);
}

int paged_prefill_f32(const float *q, int64_t q_stride, const float *kc, const float *vc,
                      int64_t num_blocks, int64_t bs, int64_t kvh, int64_t d,
                      const int64_t *table, int64_t table_len, int64_t n, int64_t L, int64_t h,
                      float scale, float *out, int64_t out_stride, int num_threads)
{
    if ((d != 64 && d != 128) || kvh < 1 || h % kvh || bs < 1) return -1;
    if (n < 1 || n > L || L > table_len * bs) return -3;
    for (int64_t i = 0; i < (L + bs - 1) / bs; i++)
        if (table[i] < 0 || table[i] >= num_blocks) return -3;
    const int64_t G = h / kvh;
    int64_t size = QUERY_TILE;  /* query tokens per item */
    while (size > MIN_QUERY_TILE && kvh * ((n + size - 1) / size) < 4 * num_threads) size /= 2;
    const int64_t tiles = (n + size - 1) / size, items = kvh * tiles;
    const int threads = items < num_threads ? (int)items : num_threads;
    const int64_t key_tiles = (L + KEY_TILE - 1) / KEY_TILE, per_head = key_tiles * KEY_TILE * d;
    float *keys = aligned_alloc(64, sizeof(float) * kvh * per_head);  /* (kvh, tiles, d, tile) */
    int64_t *at = malloc(sizeof(int64_t) * L);  /* where token t's first KV head lies */
    if (!keys || !at) {
        free(keys);
        free(at);
        return -2;
    }
    for (int64_t t = 0; t < L; t++) at[t] = (table[t / bs] * bs + t % bs) * kvh * d;
    int out_of_memory = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < kvh * key_tiles; t++)
            pack_keys(kc + t / key_tiles * d, at, t % key_tiles * KEY_TILE,
                      L - t % key_tiles * KEY_TILE, d, keys + t * KEY_TILE * d);
        scratch w;
        const int ready = scratch_alloc(&w, QUERY_TILE * G, d);
        if (!ready) {
            #pragma omp atomic write
            out_of_memory = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ready) continue;
            /* the longest items (the last query tiles) first */
            const int64_t tile = tiles - 1 - item / kvh, g = item % kvh;
            const int64_t i0 = tile * size, i1 = i0 + size < n ? i0 + size : n;
            (d == 64 ? prefill_item_64 : prefill_item_128)(
                q + g * G * d, q_stride, keys + g * per_head, vc + g * d, at, L - n, i0, i1, G,
                scale, out + g * G * d, out_stride, &w);
        }
        scratch_free(&w);
    }
    free(keys);
    free(at);
    return out_of_memory ? -2 : 0;
}
