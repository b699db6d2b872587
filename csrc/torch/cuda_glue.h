// layerstream — the CUDA-specific part of the torch glue, behind plain
// functions so that the engine compiles against a CPU-only LibTorch.
// Implemented in cuda_glue_cuda.cpp (LibTorch with CUDA and the CUDA
// toolkit) or cuda_glue_nocuda.cpp (otherwise).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/lossless.h"
#include "core/lossless_device.h"
#include "core/quant.h"
#include "core/runtime.h"

namespace layerstream::cuda_glue {

// True when this build supports CUDA and PyTorch sees at least one GPU.
bool available();
int device_count();
// The calling thread's current CUDA device (torch.cuda.current_device(); 0 without CUDA).
int current_device();
// A CUDA backend on `device` (throws a clear error without CUDA support).
std::shared_ptr<Backend> make_backend(int device);
// The framework's current CUDA stream on `device` (a cudaStream_t).
void* current_stream(int device);
// Whether the calling thread's current stream on `device` is capturing a
// CUDA graph (torch.cuda.graph, cudagraph trees); false without CUDA.
bool capturing(int device);
// Dequantizes a packed weight on `device`, enqueued on `stream` (a
// cudaStream_t of that device); sets the current device for the launch.
// With a row range (quant::row_range()'s rules; row_end < 0 = all rows),
// only those rows, written at `out` (quant::dequantize_rows_cuda).
void dequantize_on(const quant::PackedLayout& layout, const void* packed, void* out,
                   quant::OutDtype dtype, int device, void* stream, int64_t row_begin = 0,
                   int64_t row_end = -1);
// Decodes a lossless-coded weight on `device`, enqueued on `stream`
// (lossless::decode_cuda: `header` read on the host from the same bytes).
void lossless_decode_on(const lossless::Header& header, const void* coded, size_t coded_bytes, void* out,
                        int device, void* stream);
// Decodes pieces of one coded tensor on `device`, enqueued on `stream`
// (lossless::decode_pieces_cuda: `shared` is any piece's layout).
void lossless_decode_pieces_on(const lossless::Layout& shared, const void* coded,
                               const std::vector<lossless::device::PieceJob>& jobs, void* out, int device,
                               void* stream);
// Casts `numel` contiguous elements on `device`, enqueued on `stream`, as
// torch's Tensor::to(dtype) does (same kernel, same rounding); sets the
// current device and stream for the launch. No allocation.
void cast_on(const void* src, c10::ScalarType from, void* dst, c10::ScalarType to, int64_t numel,
             int device, void* stream);

// Runs fn with `stream` (a cudaStream_t of `device`) as the calling thread's
// current CUDA stream on `device`: what c10d's Work::wait() makes wait for a
// collective (engine_distributed.cpp).
void with_current_stream(int device, void* stream, const std::function<void()>& fn);

// Hands `t`'s memory to torch's CUDA caching allocator with `stream` (a
// cudaStream_t of `device`) recorded as a user, as Tensor.record_stream does:
// once every reference to it is gone, its block is not reused before the
// work enqueued on `stream` until then has finished. True when the allocator
// took it; false (nothing done) when `t`'s memory is not the allocator's (a
// tensor from from_blob, another allocator): then the caller must hold `t`
// until that work has finished. docs/design/activations.md, "Streams".
bool record_stream(const at::Tensor& t, int device, void* stream);

// Makes `device` the calling thread's current CUDA device the way torch's own
// device guards do: exchange_device returns the previous device (-1 when
// nothing changed; always -1 without CUDA), restore_device puts it back
// without creating a CUDA context on it, which a bare cudaSetDevice would
// (CUDA 12+). The engine holds a DeviceScope around every entry point that
// reaches the CUDA backend, so the backend's own guards find its device
// already current, and a process streaming to cuda:1 creates no context on
// GPU 0.
int exchange_device(int device);
void restore_device(int previous);

class DeviceScope {
 public:
  // device < 0 (the sim device): does nothing.
  explicit DeviceScope(int device) : prev_(device >= 0 ? exchange_device(device) : -1) {}
  ~DeviceScope() {
    if (prev_ >= 0) restore_device(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_;
};

}  // namespace layerstream::cuda_glue
