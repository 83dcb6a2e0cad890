/* The AVX-512 variant (compiled with the AVX2 flags plus AVX-512 F/BW/VL/DQ and VNNI; runs where
 * the CPU has them): the same sources, with AVX-512's 32 vector registers where a kernel has a path
 * for them (paged attention scores two query vectors at a time). */
#define CPU_KERNELS_TABLE specserve_cpu_kernels_avx512
#include "cpu_kernels_table.h"
