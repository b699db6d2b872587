// layerstream._C's host optimizer functions (bindings_optim.cpp), added to the
// module by bindings.cpp's PYBIND11_MODULE.
#pragma once

#include <pybind11/pybind11.h>

namespace layerstream_bindings {

// The host optimizers (layerstream/host_optim.h) for python/layerstream/optim.py.
void bind_optim(pybind11::module& m);

}  // namespace layerstream_bindings
