// layerstream — the CUDA decoder of the lossless format. See lossless.h; the
// per-block code is core/lossless_device.h (shared with the CPU tests).
//
// Work split: one thread per coded block (default 4096 elements). Each
// thread block first builds the 4096-entry decode table (16 KiB) in shared
// memory from the 256 code lengths passed with the launch: thread 0 derives
// the canonical code, then every thread fills its share of the entries.
// A thread then walks its block's bit stream (a 64-bit window, one table
// lookup per one or two symbols) and writes 8 elements at a time with
// 16-byte stores, their raw bytes read 8 at a time.
#include "kernels/cuda/lossless.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "core/lossless_device.h"
#include "kernels/cuda/stream_device.cuh"

namespace layerstream {
namespace lossless {
namespace {

constexpr int kThreads = 64;  // coded blocks per thread block (a 4096 x 4096 weight: 64 thread blocks)

struct KernelArgs {
  device::Sections sections;
  uint8_t len[256];
};

template <class S>
__global__ void __launch_bounds__(kThreads) decode_kernel(const KernelArgs a, typename S::T* __restrict__ out) {
  __shared__ device::Canonical canon;
  __shared__ uint32_t table[device::kTableSize];
  __shared__ uint8_t len[256];
  for (int s = threadIdx.x; s < 256; s += blockDim.x) len[s] = a.len[s];
  __syncthreads();
  if (threadIdx.x == 0) device::canonical(len, &canon);
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < device::kTableSize; i += blockDim.x) table[i] = device::table_entry(canon, i);
  __syncthreads();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < a.sections.num_blocks) (void)device::decode_block_at<S>(a.sections, table, len, b, out);
}

// Pieces: blockIdx.y is the piece (one job of the launch), blockIdx.x its
// 64 coded blocks; the table is built from the piece's own header.
constexpr int kPiecesPerLaunch = 128;  // 2 KiB of jobs in the launch's parameters

struct PiecesArgs {
  device::Sections shared;  // base nullptr; stream_words from each piece
  const uint8_t* coded = nullptr;
  char* out = nullptr;
  device::PieceJob jobs[kPiecesPerLaunch];
};

template <class S>
__global__ void __launch_bounds__(kThreads) decode_pieces_kernel(const PiecesArgs a) {
  __shared__ device::Canonical canon;
  __shared__ uint32_t table[device::kTableSize];
  __shared__ uint8_t len[256];
  const device::PieceJob job = a.jobs[blockIdx.y];
  const uint8_t* piece = a.coded + job.coded_offset;
  for (int s = threadIdx.x; s < 256; s += blockDim.x) len[s] = device::code_length_at(piece, s);
  __syncthreads();
  if (threadIdx.x == 0) device::canonical(len, &canon);
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < device::kTableSize; i += blockDim.x) table[i] = device::table_entry(canon, i);
  __syncthreads();
  const device::Sections sec = device::piece_sections(a.shared, piece);
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < sec.num_blocks)
    (void)device::decode_block_at<S>(sec, table, len, b, reinterpret_cast<typename S::T*>(a.out + job.out_offset));
}

template <class S>
cudaError_t launch_pieces(const PiecesArgs& args, unsigned pieces, cudaStream_t stream) {
  const int64_t grid = (args.shared.num_blocks + kThreads - 1) / kThreads;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid), pieces);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  return cudaLaunchKernelEx(&cfg, decode_pieces_kernel<S>, args);
}

template <class S>
cudaError_t launch(const KernelArgs& args, void* out, cudaStream_t stream) {
  const int64_t grid = (args.sections.num_blocks + kThreads - 1) / kThreads;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  return cudaLaunchKernelEx(&cfg, decode_kernel<S>, args, static_cast<typename S::T*>(out));
}

}  // namespace

void decode_cuda(const Header& header, const void* coded_dev, size_t coded_bytes, void* out_dev,
                 void* cuda_stream) {
  // All argument checks come before the first CUDA call.
  const Layout& L = header.layout;
  LS_CHECK(L.dtype == Dtype::BF16 || L.dtype == Dtype::F16 || L.dtype == Dtype::F32,
           "lossless::decode_cuda: unknown dtype ", static_cast<int>(L.dtype));
  LS_CHECK(coded_bytes >= L.total_bytes(), "lossless::decode_cuda: the coded buffer holds ", coded_bytes,
           " bytes; its header says ", L.total_bytes());
  if (L.numel == 0) return;
  LS_CHECK(coded_dev != nullptr && out_dev != nullptr, "lossless::decode_cuda: null coded or output device pointer");
  LS_CHECK(reinterpret_cast<uintptr_t>(coded_dev) % 16 == 0, "lossless::decode_cuda: the coded buffer must be "
           "16-byte aligned (got address ", coded_dev, "); use cudaMalloc'd memory or an offset that is a multiple "
           "of 256");
  LS_CHECK(reinterpret_cast<uintptr_t>(out_dev) % 16 == 0, "lossless::decode_cuda: the output must be 16-byte "
           "aligned (got address ", out_dev, "); it is written 16 bytes at a time");
  const int64_t grid = (L.num_blocks + kThreads - 1) / kThreads;
  LS_CHECK(grid <= 0x7FFFFFFF, "lossless::decode_cuda: ", L.num_blocks, " blocks are too many for one launch");
  KernelArgs args;
  args.sections = device::sections_of(L, coded_dev);
  std::memcpy(args.len, header.code_lengths, sizeof args.len);
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);

  cuda_detail::StreamDeviceGuard guard(stream, out_dev, "lossless::decode_cuda");
  cudaError_t err = cudaSuccess;
  switch (L.dtype) {
    case Dtype::BF16: err = launch<device::Bf16>(args, out_dev, stream); break;
    case Dtype::F16: err = launch<device::F16>(args, out_dev, stream); break;
    case Dtype::F32: err = launch<device::F32>(args, out_dev, stream); break;
  }
  if (err != cudaSuccess) {
    cuda_detail::clear_error(err);
    LS_FAIL("lossless::decode_cuda: kernel launch for ", L.numel, " elements failed: ", cudaGetErrorString(err),
            " (", cudaGetErrorName(err), ")");
  }
}

void decode_pieces_cuda(const Layout& L, const void* coded_dev, const device::PieceJob* jobs, size_t num_jobs,
                        void* out_dev, void* cuda_stream) {
  // All argument checks come before the first CUDA call.
  LS_CHECK(L.dtype == Dtype::BF16 || L.dtype == Dtype::F16 || L.dtype == Dtype::F32,
           "lossless::decode_pieces_cuda: unknown dtype ", static_cast<int>(L.dtype));
  if (L.numel == 0 || num_jobs == 0) return;
  LS_CHECK(coded_dev != nullptr && out_dev != nullptr && jobs != nullptr,
           "lossless::decode_pieces_cuda: null coded, output or jobs pointer");
  for (size_t k = 0; k < num_jobs; ++k)
    LS_CHECK((reinterpret_cast<uintptr_t>(coded_dev) + jobs[k].coded_offset) % 16 == 0 &&
                 (reinterpret_cast<uintptr_t>(out_dev) + jobs[k].out_offset) % 16 == 0,
             "lossless::decode_pieces_cuda: piece ", k, "'s coded buffer and output must be 16-byte aligned "
             "(coded at offset ", jobs[k].coded_offset, ", output at ", jobs[k].out_offset, ")");
  const int64_t grid = (L.num_blocks + kThreads - 1) / kThreads;
  LS_CHECK(grid <= 0x7FFFFFFF, "lossless::decode_pieces_cuda: ", L.num_blocks, " blocks are too many for one launch");
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  cuda_detail::StreamDeviceGuard guard(stream, out_dev, "lossless::decode_pieces_cuda");
  PiecesArgs args;
  args.shared = device::sections_of(L, nullptr);
  args.coded = static_cast<const uint8_t*>(coded_dev);
  args.out = static_cast<char*>(out_dev);
  for (size_t first = 0; first < num_jobs; first += kPiecesPerLaunch) {
    const size_t n = std::min<size_t>(kPiecesPerLaunch, num_jobs - first);
    for (size_t k = 0; k < n; ++k) args.jobs[k] = jobs[first + k];
    cudaError_t err = cudaSuccess;
    switch (L.dtype) {
      case Dtype::BF16: err = launch_pieces<device::Bf16>(args, static_cast<unsigned>(n), stream); break;
      case Dtype::F16: err = launch_pieces<device::F16>(args, static_cast<unsigned>(n), stream); break;
      case Dtype::F32: err = launch_pieces<device::F32>(args, static_cast<unsigned>(n), stream); break;
    }
    if (err != cudaSuccess) {
      cuda_detail::clear_error(err);
      LS_FAIL("lossless::decode_pieces_cuda: kernel launch for ", n, " pieces of ", L.numel,
              " elements failed: ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ")");
    }
  }
}

}  // namespace lossless
}  // namespace layerstream
