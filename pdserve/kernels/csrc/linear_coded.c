/* y = x W^T (+ b) for float32 on CPUs, on a weight held in fewer bytes that give back its
 * float32 values exactly:
 *
 *   8-bit codes: every run of 32 inputs of an output row is scale * code + offset, as in a
 *     block-quantized checkpoint (GGUF's Q4_0, Q4_1, Q8_0) whose float32 values the model
 *     computes with.
 *       codes   (ceil(n / 32), k, 32) int8, linear.c's panel layout, zero past n
 *       params  (ceil(n / 32), k / 32, 2, 32) float32: for each panel and run of 32 inputs,
 *               the 32 outputs' scales, then their offsets (k a multiple of 32)
 *   4-bit codes: the same, where every code lies in 0 .. 15 and every scale and offset is a
 *     float16 value (GGUF's Q4_1: half the bytes of the 8-bit form).
 *       codes   (ceil(n / 32), k, 16) uint8: byte j holds output j's code in its low four
 *               bits and output j + 16's in its high four
 *       params  (ceil(n / 32), k / 32, 2, 32) float16, laid out as above
 *   bfloat16: every value is a bfloat16 one (a bf16 checkpoint computed in float32).
 *       codes   (ceil(n / 32), k, 32) uint16, the values' upper halves; params NULL
 * `code_bits` names the form: 8, 4 or 16.
 *
 * Each weight is rebuilt in registers (scale * code is exact, so adding the offset rounds
 * once, as the checkpoint's dequantization did; a bfloat16 value is the upper half of its
 * float32) and enters the same fused multiply-add chain over k as in linear.c (panel.h):
 * the results are linear_f32's on the float32 weight, bit for bit, while fewer bytes stream
 * from memory: about 1.25 a weight with 8-bit codes, 0.63 with 4-bit ones, 2 with bfloat16,
 * against 4. Rebuilding costs two to four vector operations per vector of weights, so this
 * pays for the few rows of a decode step (the caller picks). Up to GROUP rows rebuild in
 * registers as they go (with AVX2's 8 lanes, a panel's 32 outputs in two passes of 16, as
 * linear.c does). With more rows than that, codes take each chunk of 128 inputs rebuilt once
 * into L1 and shared, groups of up to SHARED_GROUP rows reading it in turn (their sums wait in
 * memory between chunks, which changes no result). From 11 to 32 rows (AVX-512), rebuilding
 * for every group of 10 took 2-21% longer with 4-bit codes, and with 8-bit ones 4-11% longer
 * at 11, 24 and 32 rows, level at 20 and 6% less at 16 (benchmarks/results/linear_cpu.md).
 * bfloat16 values, two operations to rebuild, are widened again by each group: storing and
 * rereading them cost more.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "panel.h"
#if VL > 4
#include <immintrin.h>
#endif


#define RUN 32    /* inputs per scale and offset */
#define CHUNK 128  /* inputs rebuilt at a time: 16 KiB of float32, in L1; RUN divides it */
/* GROUP: rows on weights rebuilt in registers (2 accumulators a row, 4 scale / offset
 * vectors, 2 weights, 1 input); SHARED_GROUP: rows on a rebuilt chunk (2 accumulators a row,
 * 2 weights, 1 input), by the target's vector registers (vec.h's VREGS). */
#if VREGS == 32
#define GROUP 10
#define SHARED_GROUP 14
#define GROUP_CASES CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) \
    CASE(10)
#define SHARED_CASES GROUP_CASES CASE(11) CASE(12) CASE(13) CASE(14)
#else
#define GROUP 4
#define SHARED_GROUP 6
#define GROUP_CASES CASE(1) CASE(2) CASE(3) CASE(4)
#define SHARED_CASES GROUP_CASES CASE(5) CASE(6)
#endif

/* VL codes, bits `shift` .. `shift` + 3 of VL bytes (4-bit codes), VL float16 values and VL
 * bfloat16 ones (their bit patterns) widened to float32, all exact: with the vector
 * instructions on 16 and 8 lanes (GCC's vector extensions went through scalars there), with
 * the vector extensions on 4, so that the same source builds for SSE2 and NEON. */
#if VL == 16
static inline vf widen_codes(const int8_t *c)
{
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
}

static inline vf widen_nibbles(const uint8_t *b, int shift)
{
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    return (vf)_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, shift),
                                                   _mm512_set1_epi32(15)));
}

static inline vf widen_f16(const uint16_t *h)
{
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

static inline vf widen_bf16(const uint16_t *h)
{
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
}
#elif VL == 8
static inline vf widen_codes(const int8_t *c)
{
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

static inline vf widen_nibbles(const uint8_t *b, int shift)
{
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    return (vf)_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, shift),
                                                   _mm256_set1_epi32(15)));
}

static inline vf widen_f16(const uint16_t *h)
{
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

static inline vf widen_bf16(const uint16_t *h)
{
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}
#else
typedef int8_t v4i8 __attribute__((vector_size(4)));
typedef uint8_t v4u8 __attribute__((vector_size(4)));
typedef uint16_t v4u16 __attribute__((vector_size(8)));
typedef uint32_t v4u32 __attribute__((vector_size(16)));

static inline vf widen_codes(const int8_t *c)
{
    v4i8 b;
    memcpy(&b, c, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}

static inline vf widen_nibbles(const uint8_t *b, int shift)
{
    v4u8 v;
    memcpy(&v, b, sizeof v);
    return __builtin_convertvector((__builtin_convertvector(v, vi) >> shift) & 15, vf);
}

/* Without F16C: the magnitude's bits moved to float32's places and scaled by 2^112 (exact for
 * normal and subnormal values alike), infinities and NaNs rebuilt, then the sign. */
static inline vf widen_f16(const uint16_t *h)
{
    v4u16 v;
    memcpy(&v, h, sizeof v);
    const v4u32 w = __builtin_convertvector(v, v4u32), mag = (w & 0x7fff) << 13;
    const v4u32 scaled = (v4u32)((vf)mag * SPLAT(0x1p112f));
    const v4u32 special = (v4u32)((w & 0x7c00) == 0x7c00);  /* exponent all ones */
    return (vf)(((special & (mag | 0x7f800000)) | (~special & scaled)) | ((w & 0x8000) << 16));
}

static inline vf widen_bf16(const uint16_t *h)
{
    v4u16 v;
    memcpy(&v, h, sizeof v);
    return (vf)(__builtin_convertvector(v, v4u32) << 16);
}
#endif

/* A weight from its code: scale * code is exact, adding the offset rounds once. */
static inline vf decode(vf scale, vf code, vf offset) { return scale * code + offset; }

/* Input i's weights for the panel's outputs c .. c + SPAN, rebuilt: w0 for the first VL, w1
 * for the next. `run` holds the current run's scales and offsets for those outputs (s0, s1,
 * o0, o1), read afresh as each run of 32 inputs begins; the next codes are fetched on the
 * way. Output o of a 4-bit row is byte o % 16's bits 4 (o / 16) .. 4 (o / 16) + 3. */
static inline __attribute__((always_inline)) void
rebuild_input(int bits, const void *codes, const void *params, int64_t i, int c, vf run[4],
              vf *w0, vf *w1)
{
    if (bits == 16) {
        const uint16_t *h = (const uint16_t *)codes + i * PANEL + c;
        __builtin_prefetch(h + 16 * PANEL);
        *w0 = widen_bf16(h);
        *w1 = widen_bf16(h + VL);
    } else if (bits == 8) {
        if (i % RUN == 0) {
            const float *p = (const float *)params + i / RUN * 2 * PANEL + c;
            run[0] = loadv(p), run[1] = loadv(p + VL);
            run[2] = loadv(p + PANEL), run[3] = loadv(p + PANEL + VL);
        }
        const int8_t *q = (const int8_t *)codes + i * PANEL + c;
        __builtin_prefetch(q + 32 * PANEL);
        *w0 = decode(run[0], widen_codes(q), run[2]);
        *w1 = decode(run[1], widen_codes(q + VL), run[3]);
    } else {
        if (i % RUN == 0) {
            const uint16_t *p = (const uint16_t *)params + i / RUN * 2 * PANEL + c;
            run[0] = widen_f16(p), run[1] = widen_f16(p + VL);
            run[2] = widen_f16(p + PANEL), run[3] = widen_f16(p + PANEL + VL);
        }
        const uint8_t *b = (const uint8_t *)codes + i * PANEL / 2;
        __builtin_prefetch(b + 64 * PANEL / 2);
        *w0 = decode(run[0], widen_nibbles(b + c % 16, 4 * (c / 16)), run[2]);
        *w1 = decode(run[1], widen_nibbles(b + (c + VL) % 16, 4 * ((c + VL) / 16)), run[3]);
    }
}

/* rows x 32 outputs of one panel (the first `cols` stored), SPAN at a time: `mr` and `bits`
 * are constants in every call, so the loops unroll and the weights' form is fixed. */
static inline __attribute__((always_inline)) void
coded_rows(int mr, int bits, const float *x, int64_t x_stride, const void *codes,
           const void *params, int64_t k, const float *bias, float *out, int64_t out_stride,
           int64_t cols)
{
    vf acc[GROUP][2];
    for (int c = 0; c < PANEL; c += SPAN) {  /* a constant count: c is known in each pass */
        if (c >= cols) break;
        panel_start(mr, acc, bias ? bias + c : NULL);
        vf run[4] = {SPLAT(0.f), SPLAT(0.f), SPLAT(0.f), SPLAT(0.f)};
        for (int64_t i = 0; i < k; i++) {
            vf w0, w1;
            rebuild_input(bits, codes, params, i, c, run, &w0, &w1);
            panel_step(mr, acc, x, x_stride, i, w0, w1);
        }
        panel_store(mr, acc, out + c, out_stride, cols - c < SPAN ? cols - c : SPAN);
    }
}

/* Inputs i0 .. i0 + n of a panel (i0 a multiple of RUN) rebuilt into `chunk` (n x 32). */
static inline __attribute__((always_inline)) void
rebuild_chunk(int bits, const void *codes, const void *params, int64_t i0, int64_t n,
              float *chunk)
{
    for (int c = 0; c < PANEL; c += SPAN) {
        vf run[4] = {SPLAT(0.f), SPLAT(0.f), SPLAT(0.f), SPLAT(0.f)};
        for (int64_t i = i0; i < i0 + n; i++) {
            vf w0, w1;
            rebuild_input(bits, codes, params, i, c, run, &w0, &w1);
            storev(chunk + (i - i0) * PANEL + c, w0);
            storev(chunk + (i - i0) * PANEL + c + VL, w1);
        }
    }
}

/* acc (mr x 32, in memory between chunks) += rows x chunk for inputs i0 .. i0 + n: the same
 * multiply-add chain, continued where the previous chunk left it. */
static inline __attribute__((always_inline)) void
chunk_rows(int mr, const float *x, int64_t x_stride, int64_t i0, int64_t n, const float *chunk,
           float *acc_rows)
{
    vf acc[SHARED_GROUP][2];
    for (int c = 0; c < PANEL; c += SPAN) {
        for (int m = 0; m < mr; m++) {
            acc[m][0] = loadv(acc_rows + m * PANEL + c);
            acc[m][1] = loadv(acc_rows + m * PANEL + c + VL);
        }
        for (int64_t i = 0; i < n; i++)
            panel_step(mr, acc, x + i0, x_stride, i, loadv(chunk + i * PANEL + c),
                       loadv(chunk + i * PANEL + c + VL));
        for (int m = 0; m < mr; m++) {
            storev(acc_rows + m * PANEL + c, acc[m][0]);
            storev(acc_rows + m * PANEL + c + VL, acc[m][1]);
        }
    }
}

static void chunk_group(int64_t mr, const float *x, int64_t x_stride, int64_t i0, int64_t n,
                        const float *chunk, float *acc_rows)
{
    switch (mr) {
#define CASE(m) case m: chunk_rows(m, x, x_stride, i0, n, chunk, acc_rows); break;
    SHARED_CASES
#undef CASE
    }
}

/* This thread's scratch of `floats` floats (kept for its next call); NULL if out of memory. */
static float *scratch(int64_t floats)
{
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (floats > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)((floats + 15) / 16 * 64));
        capacity = buffer ? floats : 0;
    }
    return buffer;
}

/* All rows x 32 outputs of one panel on codes (bits 4 or 8), each chunk of inputs rebuilt once
 * for every group of rows (rather than once per group): for more rows than one group holds. */
static int shared_rows(int bits, const float *x, int64_t x_stride, int64_t rows,
                       const void *codes, const void *params, int64_t k, const float *bias,
                       float *out, int64_t out_stride, int64_t cols)
{
    float *chunk = scratch(CHUNK * PANEL + rows * PANEL);
    if (!chunk) return 0;
    float *acc_rows = chunk + CHUNK * PANEL;
    for (int64_t m = 0; m < rows; m++)
        for (int j = 0; j < PANEL; j++) acc_rows[m * PANEL + j] = bias ? bias[j] : 0.f;
    const int64_t groups = (rows + SHARED_GROUP - 1) / SHARED_GROUP;
    for (int64_t i0 = 0; i0 < k; i0 += CHUNK) {
        const int64_t n = k - i0 < CHUNK ? k - i0 : CHUNK;
        if (bits == 4) rebuild_chunk(4, codes, params, i0, n, chunk);
        else rebuild_chunk(8, codes, params, i0, n, chunk);
        for (int64_t g = 0, r = 0; g < groups; g++) {
            const int64_t mr = (rows - r) / (groups - g);
            chunk_group(mr, x + r * x_stride, x_stride, i0, n, chunk, acc_rows + r * PANEL);
            r += mr;
        }
    }
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < cols; j++) out[m * out_stride + j] = acc_rows[m * PANEL + j];
    return 1;
}

static void coded_group(int64_t mr, int bits, const float *x, int64_t x_stride,
                        const void *codes, const void *params, int64_t k, const float *bias,
                        float *out, int64_t out_stride, int64_t cols)
{
    switch (mr + 100 * (bits / 4)) {  /* 4 bits: 100 + mr, 8: 200 + mr, 16: 400 + mr */
#define ARGS x, x_stride, codes, params, k, bias, out, out_stride, cols
#define CASE(m) \
    case m + 100: coded_rows(m, 4, ARGS); break; \
    case m + 200: coded_rows(m, 8, ARGS); break; \
    case m + 400: coded_rows(m, 16, ARGS); break;
    GROUP_CASES
#undef CASE
#undef ARGS
    }
}

void linear_coded_f32(const float *x, int64_t x_stride, int64_t rows, const void *codes,
                      const void *params, int code_bits, int64_t n, int64_t k,
                      const float *bias, float *out, int64_t out_stride, int num_threads)
{
    const int64_t param_bytes = code_bits == 4 ? 2 : 4;  /* float16 or float32 */
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
        float padded_bias[PANEL];
        const float *b = panel_bias(bias, c0, cols, padded_bias);
        const int64_t groups = (rows + GROUP - 1) / GROUP;
        const void *panel = (const char *)codes + p * k * PANEL * code_bits / 8;
        const void *run_params = code_bits == 16 ? NULL
            : (const char *)params + p * (k / RUN) * 2 * PANEL * param_bytes;
        if (groups > 1 && code_bits != 16
                && shared_rows(code_bits, x, x_stride, rows, panel, run_params, k, b, out + c0,
                               out_stride, cols))
            continue;
        for (int64_t g = 0, r = 0; g < groups; g++) {
            const int64_t mr = (rows - r) / (groups - g);
            coded_group(mr, code_bits, x + r * x_stride, x_stride, panel, run_params, k, b,
                        out + r * out_stride + c0, out_stride, cols);
            r += mr;
        }
    }
}

/* The coded form of a float32 weight, found and proved: for each run of 32 values, the first
 * of `num_guesses` (scale, offset) guesses under which decode, as the kernel runs it, gives
 * every value back bit for bit from codes in [-128, 127]. runs: how many runs of 32 at v;
 * guess_scales, guess_offsets: (num_guesses, runs); codes: (runs, 32); scales, offsets:
 * (runs,). Returns how many runs no guess rebuilds (their codes are left zero). */
int64_t code_runs_f32(const float *v, int64_t runs, const float *guess_scales,
                      const float *guess_offsets, int64_t num_guesses, int8_t *codes,
                      float *scales, float *offsets, int num_threads)
{
    int64_t failed = 0;
    #pragma omp parallel for reduction(+:failed) num_threads(num_threads)
    for (int64_t r = 0; r < runs; r++) {
        const float *x = v + r * RUN;
        int8_t *c = codes + r * RUN;
        int found = 0;
        for (int64_t g = 0; g < num_guesses && !found; g++) {
            const float s = guess_scales[g * runs + r], o = guess_offsets[g * runs + r];
            int in_range = 1;
            for (int j = 0; j < RUN; j++) {
                const float q = s == 0.f ? 0.f : __builtin_rintf((x[j] - o) / s);
                in_range &= q >= -128.f && q <= 127.f;  /* false for NaN too */
                c[j] = in_range ? (int8_t)q : 0;
            }
            float rebuilt[RUN];
            for (int j = 0; j < RUN; j += VL)
                storev(rebuilt + j, decode(SPLAT(s), widen_codes(c + j), SPLAT(o)));
            found = in_range && memcmp(rebuilt, x, sizeof rebuilt) == 0;
            if (found) { scales[r] = s; offsets[r] = o; }
        }
        if (!found) {
            memset(c, 0, RUN);
            failed++;
        }
    }
    return failed;
}

