// Used when LibTorch or the toolkit has no CUDA: every CUDA request fails clearly.
#ifndef LS_TORCH_CUDA
#include "core/error.h"
#include "cuda_glue.h"

namespace layerstream::cuda_glue {

bool available() { return false; }
int device_count() { return 0; }
int current_device() { return 0; }
std::shared_ptr<Backend> make_backend(int) {
  LS_FAIL("this layerstream build has no CUDA support (built against a CPU-only LibTorch or "
          "without the CUDA toolkit); use the simulated device, \"sim\"");
}
bool capturing(int) { return false; }
void* current_stream(int) { LS_FAIL("this layerstream build has no CUDA support"); }
void dequantize_on(const quant::PackedLayout&, const void*, void*, quant::OutDtype, int, void*, int64_t,
                   int64_t) {
  LS_FAIL("this layerstream build has no CUDA support");
}
void lossless_decode_on(const lossless::Header&, const void*, size_t, void*, int, void*) {
  LS_FAIL("this layerstream build has no CUDA support");
}
void lossless_decode_pieces_on(const lossless::Layout&, const void*, const std::vector<lossless::device::PieceJob>&,
                               void*, int, void*) {
  LS_FAIL("this layerstream build has no CUDA support");
}
void cast_on(const void*, c10::ScalarType, void*, c10::ScalarType, int64_t, int, void*) {
  LS_FAIL("this layerstream build has no CUDA support");
}
void with_current_stream(int, void*, const std::function<void()>&) {
  LS_FAIL("this layerstream build has no CUDA support");
}
bool record_stream(const at::Tensor&, int, void*) { return false; }
int exchange_device(int) { return -1; }
void restore_device(int) {}

}  // namespace layerstream::cuda_glue
#endif
