/* The AVX2 variant (compiled with -mavx2 -mfma -mf16c; runs where the CPU reports all three). */
#define CPU_KERNELS_TABLE specserve_cpu_kernels_avx2
#include "cpu_kernels_table.h"
