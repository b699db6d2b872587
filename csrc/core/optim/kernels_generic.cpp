// The optimizer loops for the compiler's baseline instruction set (see kernels.h).
#define LS_OPTIM_ISA generic
#define LS_OPTIM_ISA_NAME "generic"
#include "core/optim/kernels_impl.h"
