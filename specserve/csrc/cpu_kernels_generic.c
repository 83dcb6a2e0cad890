/* The portable variant: plain C, for any CPU (compiled without instruction-set flags). */
#define CPU_KERNELS_TABLE specserve_cpu_kernels_generic
#include "cpu_kernels_table.h"
