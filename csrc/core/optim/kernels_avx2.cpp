// The optimizer loops compiled for AVX2 (this file gets -mavx2 on x86-64; see
// csrc/core/CMakeLists.txt). Chosen at run time when the CPU has AVX2.
#if defined(__x86_64__) && defined(__AVX2__)
#define LS_OPTIM_ISA avx2
#define LS_OPTIM_ISA_NAME "avx2"
#define LS_OPTIM_AVX2_SR  // bf16 parameters and states: the block by hand (kernels_avx2_sr.h)
#include "core/optim/kernels_impl.h"
#endif
