// The optimizer loops compiled for AVX-512 (this file gets -mavx512f
// -mavx512bw -mavx512vl -mavx512dq and 512-bit vectors on x86-64; see
// csrc/core/CMakeLists.txt). Chosen at run time when the CPU has those.
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LS_OPTIM_ISA avx512
#define LS_OPTIM_ISA_NAME "avx512"
#include "core/optim/kernels_impl.h"
#endif
