/* Runs the native kernels of a build for another machine (under an emulator, for
 * tests/unit/test_native_arm.py): reads raw inputs, writes raw float32 outputs.
 *
 *   native_driver f32 ROWS N K X PANELS BIAS OUT
 *   native_driver coded BITS ROWS N K X CODES PARAMS BIAS OUT
 *   native_driver silu ROWS N K X PANELS OUT      (PANELS of 2N outputs: gate, then up)
 *   native_driver decode NUM_BLOCKS BLOCK_SIZE KVH D H B MAX_BLOCKS SCALE Q KC VC TABLES LENS
 *                 OUT
 *   native_driver prefill NUM_BLOCKS BLOCK_SIZE KVH D H N L TABLE_LEN SCALE Q KC VC TABLE OUT
 *   native_driver lanes
 * PARAMS or BIAS "-" for none. decode: B decodes, query rows 0 .. B - 1 of Q (B, H, D), int64
 * TABLES (B, MAX_BLOCKS) and LENS (B,); prefill: the last N of L tokens, int64 TABLE. Files
 * hold the tensors' bytes as Python wrote them (little-endian, contiguous). Exits 0 on
 * success (printing the vector lanes for `lanes`), 3 when a kernel refuses its input. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../pdserve/kernels/csrc/kernels.h"

static void *slurp(const char *path)
{
    if (!strcmp(path, "-")) return NULL;
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *data = malloc(size ? size : 1);
    if (!data || fread(data, 1, size, f) != (size_t)size) { perror(path); exit(2); }
    fclose(f);
    return data;
}

static void spill(const char *path, const float *out, int64_t count)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(out, sizeof(float), count, f) != (size_t)count) { perror(path); exit(2); }
    fclose(f);
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "lanes")) {
        printf("%d\n", vector_lanes());
        return 0;
    }
    if (argc == 9 && !strcmp(argv[1], "f32")) {
        const int64_t rows = atoll(argv[2]), n = atoll(argv[3]), k = atoll(argv[4]);
        float *out = malloc(sizeof(float) * rows * n);
        linear_f32(slurp(argv[5]), k, rows, slurp(argv[6]), n, k, slurp(argv[7]), out, n, 2);
        spill(argv[8], out, rows * n);
        return 0;
    }
    if (argc == 8 && !strcmp(argv[1], "silu")) {
        const int64_t rows = atoll(argv[2]), n = atoll(argv[3]), k = atoll(argv[4]);
        float *out = malloc(sizeof(float) * rows * n);
        if (linear_silu_mul_f32(slurp(argv[5]), k, rows, slurp(argv[6]), n, k, out, n, 2))
            return 3;
        spill(argv[7], out, rows * n);
        return 0;
    }
    if (argc == 11 && !strcmp(argv[1], "coded")) {
        const int bits = atoi(argv[2]);
        const int64_t rows = atoll(argv[3]), n = atoll(argv[4]), k = atoll(argv[5]);
        float *out = malloc(sizeof(float) * rows * n);
        linear_coded_f32(slurp(argv[6]), k, rows, slurp(argv[7]), slurp(argv[8]), bits, n, k,
                         slurp(argv[9]), out, n, 2);
        spill(argv[10], out, rows * n);
        return 0;
    }
    if (argc == 16 && !strcmp(argv[1], "decode")) {
        const int64_t nb = atoll(argv[2]), bs = atoll(argv[3]), kvh = atoll(argv[4]);
        const int64_t d = atoll(argv[5]), h = atoll(argv[6]), b = atoll(argv[7]);
        int64_t *rows = malloc(sizeof(int64_t) * b);
        for (int64_t i = 0; i < b; i++) rows[i] = i;
        float *out = malloc(sizeof(float) * b * h * d);
        if (paged_decode_f32(slurp(argv[10]), h * d, slurp(argv[11]), slurp(argv[12]), nb, bs,
                             kvh, d, slurp(argv[13]), atoll(argv[8]), slurp(argv[14]), rows, b,
                             h, strtof(argv[9], NULL), out, 2))
            return 3;
        spill(argv[15], out, b * h * d);
        return 0;
    }
    if (argc == 16 && !strcmp(argv[1], "prefill")) {
        const int64_t nb = atoll(argv[2]), bs = atoll(argv[3]), kvh = atoll(argv[4]);
        const int64_t d = atoll(argv[5]), h = atoll(argv[6]), n = atoll(argv[7]);
        float *out = malloc(sizeof(float) * n * h * d);
        if (paged_prefill_f32(slurp(argv[11]), h * d, slurp(argv[12]), slurp(argv[13]), nb, bs,
                              kvh, d, slurp(argv[14]), atoll(argv[9]), n, atoll(argv[8]), h,
                              strtof(argv[10], NULL), out, h * d, 2))
            return 3;
        spill(argv[15], out, n * h * d);
        return 0;
    }
    fprintf(stderr, "usage: see the comment at the top of native_driver.c\n");
    return 1;
}
