/* decoder_layers.c's interface; kernels/cpu_layers.py mirrors these structs with ctypes. */
#pragma once
#include <stdint.h>

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t coded_max_rows;  /* steps of up to this many tokens use the coded weights */
} decoder_shape;

/* One layer's float32 weights; projections in linear.c's panels, of (out, in) weights:
 * qkv ((heads + 2 kv_heads) head_dim, hidden) with its bias or NULL, o (hidden, heads
 * head_dim), gate_up (2 intermediate, hidden), down (hidden, intermediate). */
typedef struct {
    const float *input_norm, *post_norm;  /* (hidden,) */
    const float *qkv, *qkv_bias, *o, *gate_up, *down;
    /* the same projections as linear_coded.c's codes, params and code bits: codes NULL where
     * a weight is not so held, params NULL where its codes are bfloat16 values */
    const void *qkv_codes, *o_codes, *gate_up_codes, *down_codes;
    const void *qkv_params, *o_params, *gate_up_params, *down_params;
    int64_t qkv_bits, o_bits, gate_up_bits, down_bits;
} layer_weights;

/* One step's attention batch (attention.py's AttentionMetadata), int64 throughout. */
typedef struct {
    const int64_t *slots;                  /* (T,) flat cache slot of each token */
    int64_t num_decodes, decode_max_blocks;
    const int64_t *decode_rows, *decode_lens, *decode_tables;  /* (B,), (B,), (B, max) */
    int64_t num_prefills, prefill_max_blocks;
    const int64_t *prefill_start, *prefill_end, *prefill_context, *prefill_table_lens;  /* (P,) */
    const int64_t *prefill_tables;         /* (P, prefill_max_blocks) */
    /* the rows whose final states the step needs, strictly increasing; NULL: every row */
    int64_t num_outputs;
    const int64_t *output_rows;            /* (num_outputs,) */
} step_batch;

enum {
    DL_UNSUPPORTED = -1,  /* head size or head counts the attention kernels do not serve */
    DL_NO_MEMORY = -2,
    DL_BAD_SLOT = -3,     /* a token's cache slot outside the cache */
    DL_BAD_DECODE = -4,   /* a decode that does not fit its block table or the cache */
    DL_BAD_PREFILL = -5,  /* likewise a prefill span */
    DL_BAD_OUTPUT = -6,   /* output rows not strictly increasing within the step */
};

/* 0, or the error code of what in the step does not fit the shape, the cache or its own
 * rows; decode block tables and lengths are left to the attention kernel. */
int decoder_check_step(int64_t T, const decoder_shape *s, int64_t num_blocks, int64_t bs,
                       const step_batch *b);
/* Every layer on x (T, hidden), in place. With output rows, the last layer runs for those rows
 * alone and leaves their states in x's first num_outputs rows (decoder_layers.c). */
int decoder_layers_f32(float *x, int64_t T, const decoder_shape *s, const layer_weights *layers,
                       float *kv, int64_t num_blocks, int64_t bs, const float *cos,
                       const float *sin, const step_batch *b, int num_threads);
/* The same for a step of decodes alone (no prefill span, every row an output, decode row i
 * being token i), its rows split into num_lanes consecutive lanes at bounds (num_lanes + 1
 * increasing offsets from 0 to T), each lane through every layer on one thread of its own
 * (decoder_lanes.c). */
int decoder_lanes_f32(float *x, int64_t T, const decoder_shape *s, const layer_weights *layers,
                      float *kv, int64_t num_blocks, int64_t bs, const float *cos,
                      const float *sin, const step_batch *b, const int64_t *bounds,
                      int64_t num_lanes);
