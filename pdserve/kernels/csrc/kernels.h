/* The native library's kernels, declared once: each source includes this, so a definition and
 * every call (decoder_layers.c calls the others) are checked against the same prototype.
 * kernels/native.py gives ctypes the same signatures. Strides are in floats. */
#pragma once
#include <stdint.h>

/* Below this many values per call, elementwise work stays on the calling thread: waking the
 * others costs more than a decode step's few rows. */
#define PARALLEL_MIN_VALUES (1 << 16)

int vector_lanes(void);
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int64_t rows, int64_t n, float eps, int num_threads);
void argmax_rows_f32(const float *x, int64_t x_stride, int64_t rows, int64_t n, int64_t *out,
                     int num_threads);
void add_rms_norm_f32(float *x, int64_t x_stride, const float *delta, int64_t delta_stride,
                      const float *w, float *out, int64_t out_stride, int64_t rows, int64_t n,
                      float eps, int num_threads);
void silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t out_stride,
                  int64_t rows, int64_t n, int num_threads);
void rotary_f32(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
                const float *cos, const float *sin, int num_threads);
void linear_f32(const float *x, int64_t x_stride, int64_t rows, const float *panels, int64_t n,
                int64_t k, const float *bias, float *out, int64_t out_stride, int num_threads);
/* out = silu(gate) * up, (rows, n), where gate_up = x W^T on panels of 2n outputs (gate, then
 * up): linear_f32 and silu_mul_f32 in one pass, bit for bit. -1 (nothing done) unless n is a
 * multiple of 32. */
int linear_silu_mul_f32(const float *x, int64_t x_stride, int64_t rows, const float *panels,
                        int64_t n, int64_t k, float *out, int64_t out_stride, int num_threads);
void linear_coded_f32(const float *x, int64_t x_stride, int64_t rows, const void *codes,
                      const void *params, int code_bits, int64_t n, int64_t k,
                      const float *bias, float *out, int64_t out_stride, int num_threads);
int64_t code_runs_f32(const float *v, int64_t runs, const float *guess_scales,
                      const float *guess_offsets, int64_t num_guesses, int8_t *codes,
                      float *scales, float *offsets, int num_threads);
int paged_decode_f32(const float *q, int64_t q_stride, const float *kc, const float *vc,
                     int64_t num_blocks, int64_t bs, int64_t kvh, int64_t d,
                     const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                     const int64_t *rows, int64_t B, int64_t h, float scale, float *out,
                     int num_threads);
int paged_prefill_f32(const float *q, int64_t q_stride, const float *kc, const float *vc,
                      int64_t num_blocks, int64_t bs, int64_t kvh, int64_t d,
                      const int64_t *table, int64_t table_len, int64_t n, int64_t L, int64_t h,
                      float scale, float *out, int64_t out_stride, int num_threads);
