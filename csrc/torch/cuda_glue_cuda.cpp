// Compiled only when LibTorch has CUDA and the CUDA toolkit is found.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include "backends/cuda/cuda_backend.h"
#include "kernels/cuda/dequant.h"
#include "kernels/cuda/lossless.h"
#include "cuda_glue.h"

namespace layerstream::cuda_glue {

bool available() { return torch::cuda::is_available(); }
int device_count() { return static_cast<int>(torch::cuda::device_count()); }
int current_device() { return static_cast<int>(c10::cuda::current_device()); }

std::shared_ptr<Backend> make_backend(int device) {
  CudaOptions o;
  o.device = device;
  return make_cuda_backend(o);
}

bool capturing(int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

void* current_stream(int device) {
  return static_cast<void*>(
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
}

void dequantize_on(const quant::PackedLayout& layout, const void* packed, void* out,
                   quant::OutDtype dtype, int device, void* stream, int64_t row_begin, int64_t row_end) {
  // The caller may be any thread (e.g. an autograd worker on another device).
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  quant::dequantize_rows_cuda(layout, packed, row_begin, row_end < 0 ? layout.rows : row_end, out, dtype,
                              stream);
}

void lossless_decode_on(const lossless::Header& header, const void* coded, size_t coded_bytes, void* out,
                        int device, void* stream) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  lossless::decode_cuda(header, coded, coded_bytes, out, stream);
}

void lossless_decode_pieces_on(const lossless::Layout& shared, const void* coded,
                               const std::vector<lossless::device::PieceJob>& jobs, void* out, int device,
                               void* stream) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  lossless::decode_pieces_cuda(shared, coded, jobs.data(), jobs.size(), out, stream);
}

void cast_on(const void* src, c10::ScalarType from, void* dst, c10::ScalarType to, int64_t numel,
             int device, void* stream) {
  const auto index = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAGuard guard(index);
  c10::cuda::CUDAStreamGuard stream_guard(
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), index));
  const auto opts = torch::TensorOptions().device(torch::kCUDA, index);
  torch::Tensor out = torch::from_blob(dst, {numel}, opts.dtype(to));
  out.copy_(torch::from_blob(const_cast<void*>(src), {numel}, opts.dtype(from)));
}

void with_current_stream(int device, void* stream, const std::function<void()>& fn) {
  const auto index = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAGuard guard(index);
  c10::cuda::CUDAStreamGuard stream_guard(
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), index));
  fn();
}

bool record_stream(const at::Tensor& t, int device, void* stream) {
  if (!t.defined() || !t.has_storage() || !t.is_cuda()) return false;
  c10::cuda::CUDACachingAllocator::CUDAAllocator* allocator = c10::cuda::CUDACachingAllocator::get();
  const c10::DataPtr& data = t.storage().data_ptr();
  // The allocator skips memory that is not its own without a word: checked
  // here, so that the caller knows whether it may let go of the tensor.
  if (allocator == nullptr || data.get() == nullptr || data.get_deleter() != allocator->raw_deleter()) return false;
  const auto index = static_cast<c10::DeviceIndex>(device);
  allocator->recordStream(data, c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), index));
  return true;
}

int exchange_device(int device) {
  const auto prev = c10::cuda::ExchangeDevice(static_cast<c10::DeviceIndex>(device));
  return prev == device ? -1 : static_cast<int>(prev);
}

void restore_device(int previous) {
  // Like CUDAGuard's destructor: a device without a context is only noted
  // as current (torch's deferred device), not initialised.
  (void)c10::cuda::MaybeSetDevice(static_cast<c10::DeviceIndex>(previous));
}

}  // namespace layerstream::cuda_glue
