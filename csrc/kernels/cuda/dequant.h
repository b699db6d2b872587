// layerstream — CUDA dequantization kernels (plain C++ header: callers need
// no CUDA includes). Implemented in dequant.cu, built into ls_cuda.
#pragma once

#include "core/quant.h"

namespace layerstream {
namespace quant {

// Dequantizes one packed tensor on the device. `packed_dev` points to the
// device copy of the buffer pack() produced (layout.total_bytes() bytes,
// 16-byte aligned; cudaMalloc memory is), `out_dev` to layout.numel()
// elements of `dtype` (bf16/f16 as raw 16-bit values). Enqueued on
// `cuda_stream` (a cudaStream_t; nullptr = the legacy default stream); the
// call returns without waiting. The kernel runs on the stream's device, which
// is made current for the launch and the caller's current device restored;
// with a default-stream handle (nullptr, cudaStreamLegacy,
// cudaStreamPerThread) it is the default stream of out_dev's device (of the
// current device if out_dev is not device memory). Both pointers must be
// usable from that device. The result is bit-identical to
// dequantize_cpu() for every code and every finite scale / zero point (GGUF:
// every block whose fp16 scale fields d / dmin / m are finite).
// Throws layerstream::Error on a bad layout, misaligned pointers (checked
// before any CUDA call), or a launch error (with cudaGetErrorString's text).
void dequantize_cuda(const PackedLayout& layout, const void* packed_dev, void* out_dev,
                     OutDtype dtype, void* cuda_stream);
// The same for rows [row_begin, row_end) only (quant::row_range()'s rules):
// reads those rows' bytes of the whole tensor's buffer at `packed_dev` and
// writes (row_end - row_begin) * cols elements at `out_dev`, bit-identical to
// those rows of the whole tensor's output. For int8 / fp8 / nf4 / int4 the
// rows' codes must start on 16 bytes (row_begin * cols a multiple of 16 for
// int8/fp8, of 32 for nf4/int4); the GGUF kernels read bytes, so for the GGUF
// formats any row range is accepted (only `packed_dev` itself must be 16-byte
// aligned).
void dequantize_rows_cuda(const PackedLayout& layout, const void* packed_dev, int64_t row_begin,
                          int64_t row_end, void* out_dev, OutDtype dtype, void* cuda_stream);

}  // namespace quant
}  // namespace layerstream
