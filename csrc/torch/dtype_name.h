// layerstream — internal: a torch dtype as messages name it. torch prints a
// ScalarType as "Float" or "Double", which neither language spells so; the
// messages say "float32", "float64" (torch.float32 in Python, torch::kFloat32
// in C++). Not installed.
#pragma once

#include <torch/torch.h>

namespace layerstream {

inline const char* dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kHalf: return "float16";
    case torch::kDouble: return "float64";
    case torch::kFloat8_e4m3fn: return "float8_e4m3fn";
    case torch::kFloat8_e5m2: return "float8_e5m2";
    case torch::kByte: return "uint8";
    case torch::kChar: return "int8";
    case torch::kShort: return "int16";
    case torch::kInt: return "int32";
    case torch::kLong: return "int64";
    case torch::kBool: return "bool";
    case torch::kComplexFloat: return "complex64";
    case torch::kComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

}  // namespace layerstream
