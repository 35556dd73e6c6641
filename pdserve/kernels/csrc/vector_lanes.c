/* Which vectors this build of the library runs on (vec.h): 16 float32 lanes for an AVX-512
 * target, 8 for an AVX2 one. kernels/native.py checks it against what it asked the compiler. */
#include "kernels.h"
#include "vec.h"

int vector_lanes(void) { return VL; }
