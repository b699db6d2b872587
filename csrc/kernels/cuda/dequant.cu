// layerstream — CUDA dequantization kernels, bit-identical to
// quant::dequantize_cpu (same fp32 operations in the same order, explicit
// round-to-nearest intrinsics so nvcc cannot contract anything, and the
// output conversion with __float2bfloat16_rn / __float2half_rn).
//
// Work split (int8 / fp8 / nf4 / int4): each thread owns 16 consecutive
// elements of the flattened [rows, cols] tensor. Full chunks load their codes
// with one 16-byte (8-bit formats) or 8-byte (4-bit formats) load and store
// with 16-byte stores when the output is 16-byte aligned; the last partial
// chunk goes element by element. A chunk of 16 never straddles an nf4 block
// (64) or an int4 group (128, and cols % 128 == 0), so those formats fetch one
// scale per chunk.
//
// Work split (GGUF q8_0 .. q6_k): each thread also owns 16 consecutive
// elements, which are always inside one block (blocks are 32 or 256 elements
// and rows are whole blocks), so blocks and rows never need a division by
// cols: 2 threads per 32-element block, 16 per 256-element k-quant block (one
// scale group of 16, half of a q4_k / q5_k group of 32). Every element is
// gguf::decode<fmt>() of core/gguf_blocks.h, the very function the CPU
// reference calls; it reads bytes (blocks are 18..210 bytes, not aligned), so
// GGUF rows may start at any byte. The tensor is always whole chunks; stores
// are 16-byte vectors when the output is 16-byte aligned, else scalar.
#include "kernels/cuda/dequant.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "core/gguf_blocks.h"
#include "kernels/cuda/stream_device.cuh"

namespace layerstream {
namespace quant {
namespace {

constexpr int kChunk = 16;
constexpr int kThreads = 256;

struct NF4Table {
  float v[16];
};

__device__ __forceinline__ float fp8_decode_dev(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu;
  const uint32_t m = c & 7u;
  if (e == 0) return __uint_as_float(__float_as_uint(__fmul_rn(static_cast<float>(m), 0.001953125f)) | sign);
  if (e == 15 && m == 7) return __uint_as_float(sign | 0x7FC00000u);
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

template <int kOut>
struct OutTraits;
template <>
struct OutTraits<0> {  // F32
  using T = float;
  // Any NaN result leaves as 0x7FC00000, the NaN dequantize_cpu produces on
  // x86/ARM (a NaN fp8 code decodes to +qNaN and the multiply propagates it).
  // The GPU's own fp32 arithmetic would give its canonical 0x7FFFFFFF instead.
  __device__ __forceinline__ static float cvt(float v) {
    return isnan(v) ? __uint_as_float(0x7FC00000u) : v;
  }
};
template <>
struct OutTraits<1> {  // BF16
  using T = unsigned short;
  __device__ __forceinline__ static unsigned short cvt(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
template <>
struct OutTraits<2> {  // F16
  using T = unsigned short;
  __device__ __forceinline__ static unsigned short cvt(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
};

// Value of element i (any i < n) without vector loads: the tail path.
template <int kFmt>
__device__ __forceinline__ float element(const uint8_t* data, const float* scales,
                                         const float* zeros, const float* nf4, int64_t cols,
                                         int64_t i) {
  if (kFmt == static_cast<int>(Format::Int8)) {
    return __fmul_rn(static_cast<float>(reinterpret_cast<const int8_t*>(data)[i]), scales[i / cols]);
  } else if (kFmt == static_cast<int>(Format::Fp8E4M3)) {
    return __fmul_rn(fp8_decode_dev(data[i]), scales[i / cols]);
  } else if (kFmt == static_cast<int>(Format::NF4)) {
    const uint32_t byte = data[i >> 1];
    const uint32_t q = (i & 1) ? (byte & 0xFu) : (byte >> 4);
    return __fmul_rn(nf4[q], scales[i / 64]);
  } else {  // Int4
    const uint32_t byte = data[i >> 1];
    const uint32_t q = (i & 1) ? (byte & 0xFu) : (byte >> 4);
    const int64_t g = i / 128;
    return __fmul_rn(__fsub_rn(static_cast<float>(q), zeros[g]), scales[g]);
  }
}

// Stores the 16 values of one chunk at dst (16-byte aligned when kVecStore).
template <int kOut, bool kVecStore>
__device__ __forceinline__ void store_chunk(typename OutTraits<kOut>::T* __restrict__ dst,
                                            const float (&v)[kChunk]) {
  if (kVecStore) {
    if (kOut == 0) {
#pragma unroll
      for (int k = 0; k < kChunk; k += 4) {
        float4 f;
        f.x = OutTraits<0>::cvt(v[k]);
        f.y = OutTraits<0>::cvt(v[k + 1]);
        f.z = OutTraits<0>::cvt(v[k + 2]);
        f.w = OutTraits<0>::cvt(v[k + 3]);
        reinterpret_cast<float4*>(dst)[k / 4] = f;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kChunk; k += 8) {
        uint4 u;
        u.x = static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k])) |
              (static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k + 1])) << 16);
        u.y = static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k + 2])) |
              (static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k + 3])) << 16);
        u.z = static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k + 4])) |
              (static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k + 5])) << 16);
        u.w = static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k + 6])) |
              (static_cast<uint32_t>(OutTraits<kOut>::cvt(v[k + 7])) << 16);
        reinterpret_cast<uint4*>(dst)[k / 8] = u;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) dst[k] = OutTraits<kOut>::cvt(v[k]);
  }
}

template <int kFmt, int kOut, bool kVecStore>
__global__ void __launch_bounds__(kThreads)
    dequant_kernel(const uint8_t* __restrict__ data, const float* __restrict__ scales,
                   const float* __restrict__ zeros, typename OutTraits<kOut>::T* __restrict__ out,
                   int64_t n, int64_t cols, NF4Table table) {
  __shared__ float nf4[16];
  if (kFmt == static_cast<int>(Format::NF4)) {
    if (threadIdx.x < 16) nf4[threadIdx.x] = table.v[threadIdx.x];
    __syncthreads();
  }
  const int64_t start = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kChunk;
  if (start >= n) return;

  if (start + kChunk > n) {  // the last, partial chunk
    for (int64_t i = start; i < n; ++i)
      out[i] = OutTraits<kOut>::cvt(element<kFmt>(data, scales, zeros, nf4, cols, i));
    return;
  }

  float v[kChunk];
  if (kFmt == static_cast<int>(Format::Int8) || kFmt == static_cast<int>(Format::Fp8E4M3)) {
    const uint4 w = *reinterpret_cast<const uint4*>(data + start);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    int64_t row = start / cols;
    int64_t col = start - row * cols;
    float s = scales[row];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      if (col == cols) {  // crossed into the next row (cols need not divide 16)
        ++row;
        col = 0;
        s = scales[row];
      }
      const uint32_t c = (words[k / 4] >> (8 * (k % 4))) & 0xFFu;
      float x;
      if (kFmt == static_cast<int>(Format::Int8)) {
        x = static_cast<float>(static_cast<int>(static_cast<int8_t>(static_cast<uint8_t>(c))));
      } else {
        x = fp8_decode_dev(c);
      }
      v[k] = __fmul_rn(x, s);
      ++col;
    }
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(data + start / 2);
    const uint32_t words[2] = {w.x, w.y};
    if (kFmt == static_cast<int>(Format::NF4)) {
      const float a = scales[start / 64];
#pragma unroll
      for (int k = 0; k < kChunk; k += 2) {
        const uint32_t byte = (words[k / 8] >> (8 * ((k / 2) % 4))) & 0xFFu;
        v[k] = __fmul_rn(nf4[byte >> 4], a);
        v[k + 1] = __fmul_rn(nf4[byte & 0xFu], a);
      }
    } else {  // Int4
      const int64_t g = start / 128;
      const float s = scales[g];
      const float z = zeros[g];
#pragma unroll
      for (int k = 0; k < kChunk; k += 2) {
        const uint32_t byte = (words[k / 8] >> (8 * ((k / 2) % 4))) & 0xFFu;
        v[k] = __fmul_rn(__fsub_rn(static_cast<float>(byte >> 4), z), s);
        v[k + 1] = __fmul_rn(__fsub_rn(static_cast<float>(byte & 0xFu), z), s);
      }
    }
  }

  store_chunk<kOut, kVecStore>(out + start, v);
}

// GGUF: thread c owns elements [16c, 16c + 16) of the flattened tensor, which
// lie in block c / (elems / 16) (rows are whole blocks, so the flat block
// index is the CPU reference's r * cols / elems + col / elems).
template <int kFmt, int kOut, bool kVecStore>
__global__ void __launch_bounds__(kThreads)
    gguf_kernel(const uint8_t* __restrict__ data, typename OutTraits<kOut>::T* __restrict__ out,
                int64_t chunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  const int per_block = gguf::block_elems(kFmt) / kChunk;  // 2 or 16 (constants once inlined)
  const int64_t blk = c / per_block;
  const int e0 = static_cast<int>(c - blk * per_block) * kChunk;  // a multiple of 16
  const uint8_t* b = data + blk * static_cast<int64_t>(gguf::block_bytes(kFmt));
  float v[kChunk];
#pragma unroll
  for (int k = 0; k < kChunk; ++k) v[k] = gguf::decode<kFmt>(b, e0 | k);  // e0 | k == e0 + k
  store_chunk<kOut, kVecStore>(out + c * kChunk, v);
}

// Returns the launch's own error (cudaLaunchKernelEx reports it directly, so
// an unrelated error left in the thread's last-error slot is not blamed on it).
// L: the layout of what is dequantized (for a row range, layout_for() of the
// range); its sections at data / scales / zeros.
// One thread per chunk of kChunk elements, kThreads per block, on `stream`.
cudaLaunchConfig_t launch_config(const PackedLayout& L, int64_t chunks, cudaStream_t stream) {
  const int64_t blocks = (chunks + kThreads - 1) / kThreads;
  LS_CHECK(blocks <= 0x7FFFFFFF, "dequantize_cuda: tensor [", L.rows, ", ", L.cols,
           "] is too large for one launch; split it");
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  return cfg;
}

template <int kFmt, int kOut>
cudaError_t launch_out(const PackedLayout& L, const uint8_t* data, const float* scales, const float* zeros,
                       void* out, bool vec_store, cudaStream_t stream) {
  const int64_t n = L.numel();
  cudaLaunchConfig_t cfg = launch_config(L, (n + kChunk - 1) / kChunk, stream);
  NF4Table table;
  for (int i = 0; i < 16; ++i) table.v[i] = kNF4Codes[i];
  using T = typename OutTraits<kOut>::T;
  T* o = static_cast<T*>(out);
  const int64_t cols = L.cols;
  if (vec_store)
    return cudaLaunchKernelEx(&cfg, dequant_kernel<kFmt, kOut, true>, data, scales, zeros, o, n,
                              cols, table);
  return cudaLaunchKernelEx(&cfg, dequant_kernel<kFmt, kOut, false>, data, scales, zeros, o, n,
                            cols, table);
}

template <int kFmt>
cudaError_t launch_fmt(const PackedLayout& L, const uint8_t* d, const float* s, const float* z, void* out,
                       OutDtype dtype, bool vec_store, cudaStream_t stream) {
  switch (dtype) {
    case OutDtype::F32: return launch_out<kFmt, 0>(L, d, s, z, out, vec_store, stream);
    case OutDtype::BF16: return launch_out<kFmt, 1>(L, d, s, z, out, vec_store, stream);
    case OutDtype::F16: return launch_out<kFmt, 2>(L, d, s, z, out, vec_store, stream);
  }
  LS_FAIL("dequantize_cuda: unknown output dtype ", static_cast<int>(dtype));
}

template <int kFmt, int kOut>
cudaError_t launch_gguf_out(const PackedLayout& L, const uint8_t* data, void* out, bool vec_store,
                            cudaStream_t stream) {
  const int64_t chunks = L.numel() / kChunk;  // cols is a multiple of 32
  cudaLaunchConfig_t cfg = launch_config(L, chunks, stream);
  using T = typename OutTraits<kOut>::T;
  T* o = static_cast<T*>(out);
  if (vec_store) return cudaLaunchKernelEx(&cfg, gguf_kernel<kFmt, kOut, true>, data, o, chunks);
  return cudaLaunchKernelEx(&cfg, gguf_kernel<kFmt, kOut, false>, data, o, chunks);
}

template <int kFmt>
cudaError_t launch_gguf(const PackedLayout& L, const uint8_t* d, void* out, OutDtype dtype, bool vec_store,
                        cudaStream_t stream) {
  static_assert(kFmt >= gguf::kQ8_0 && kFmt <= gguf::kQ6_K, "not a GGUF format");
  switch (dtype) {
    case OutDtype::F32: return launch_gguf_out<kFmt, 0>(L, d, out, vec_store, stream);
    case OutDtype::BF16: return launch_gguf_out<kFmt, 1>(L, d, out, vec_store, stream);
    case OutDtype::F16: return launch_gguf_out<kFmt, 2>(L, d, out, vec_store, stream);
  }
  LS_FAIL("dequantize_cuda: unknown output dtype ", static_cast<int>(dtype));
}

}  // namespace

void dequantize_cuda(const PackedLayout& layout, const void* packed_dev, void* out_dev,
                     OutDtype dtype, void* cuda_stream) {
  dequantize_rows_cuda(layout, packed_dev, 0, layout.rows, out_dev, dtype, cuda_stream);
}

void dequantize_rows_cuda(const PackedLayout& layout, const void* packed_dev, int64_t row_begin,
                          int64_t row_end, void* out_dev, OutDtype dtype, void* cuda_stream) {
  // All argument checks come before the first CUDA call.
  LS_CHECK(layout.format != Format::None,
           "dequantize_cuda: format 'none' has nothing to dequantize");
  LS_CHECK(layout.format != Format::Lossless, "dequantize_cuda: a lossless-coded tensor is decoded by "
           "lossless::decode_cuda (kernels/cuda/lossless.h), which needs the coded buffer's header");
  const PackedLayout want = layout_for(layout.format, layout.rows, layout.cols);
  LS_CHECK(want.block_size == layout.block_size && want.data_bytes == layout.data_bytes &&
               want.scale_bytes == layout.scale_bytes && want.zero_bytes == layout.zero_bytes,
           "dequantize_cuda: inconsistent PackedLayout (expected ", describe(want), ", got ",
           describe(layout), "); build layouts with quant::layout_for()");
  LS_CHECK(dtype == OutDtype::F32 || dtype == OutDtype::BF16 || dtype == OutDtype::F16,
           "dequantize_cuda: unknown output dtype ", static_cast<int>(dtype));
  const RowRange r = row_range(layout, row_begin, row_end);
  const PackedLayout sub = layout_for(layout.format, row_end - row_begin, layout.cols);
  if (sub.numel() == 0) return;
  LS_CHECK(packed_dev != nullptr && out_dev != nullptr,
           "dequantize_cuda: null packed or output device pointer");
  const uint8_t* base = static_cast<const uint8_t*>(packed_dev);
  const uintptr_t pa = reinterpret_cast<uintptr_t>(packed_dev);
  const uintptr_t oa = reinterpret_cast<uintptr_t>(out_dev);
  LS_CHECK(pa % 16 == 0, "dequantize_cuda: the packed buffer must be 16-byte aligned (got address ",
           packed_dev, "); use cudaMalloc'd memory or an offset that is a multiple of 256");
  // The int8 / fp8 / nf4 / int4 kernels load codes 8 or 16 bytes at a time;
  // the GGUF kernels read bytes, so their rows may start anywhere.
  LS_CHECK(is_gguf(layout.format) || (pa + r.data_begin) % 16 == 0, "dequantize_cuda: rows [", row_begin,
           ", ", row_end, ") start at byte ", r.data_begin, " of the packed codes, which is not a "
           "multiple of 16; dequantize a row range that starts on 16 bytes of codes (or the whole tensor)");
  LS_CHECK(oa % out_dtype_bytes(dtype) == 0, "dequantize_cuda: the ", to_string(dtype),
           " output pointer is not aligned to its element size");
  const bool vec_store = (oa % 16 == 0);
  const uint8_t* d = base + r.data_begin;
  const float* sc = reinterpret_cast<const float*>(base + r.scale_begin);
  const float* z = reinterpret_cast<const float*>(base + r.zero_begin);
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);

  cuda_detail::StreamDeviceGuard guard(stream, out_dev, "dequantize_cuda");
  cudaError_t err = cudaSuccess;
  switch (layout.format) {
    case Format::Int8:
      err = launch_fmt<static_cast<int>(Format::Int8)>(sub, d, sc, z, out_dev, dtype, vec_store, stream);
      break;
    case Format::Fp8E4M3:
      err = launch_fmt<static_cast<int>(Format::Fp8E4M3)>(sub, d, sc, z, out_dev, dtype, vec_store, stream);
      break;
    case Format::NF4:
      err = launch_fmt<static_cast<int>(Format::NF4)>(sub, d, sc, z, out_dev, dtype, vec_store, stream);
      break;
    case Format::Int4:
      err = launch_fmt<static_cast<int>(Format::Int4)>(sub, d, sc, z, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ8_0:
      err = launch_gguf<gguf::kQ8_0>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ4_0:
      err = launch_gguf<gguf::kQ4_0>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ4_1:
      err = launch_gguf<gguf::kQ4_1>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ5_0:
      err = launch_gguf<gguf::kQ5_0>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ5_1:
      err = launch_gguf<gguf::kQ5_1>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ2_K:
      err = launch_gguf<gguf::kQ2_K>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ3_K:
      err = launch_gguf<gguf::kQ3_K>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ4_K:
      err = launch_gguf<gguf::kQ4_K>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ5_K:
      err = launch_gguf<gguf::kQ5_K>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::GgufQ6_K:
      err = launch_gguf<gguf::kQ6_K>(sub, d, out_dev, dtype, vec_store, stream);
      break;
    case Format::None:
    case Format::Lossless:
      break;  // rejected above
  }
  if (err != cudaSuccess) {
    cuda_detail::clear_error(err);
    LS_FAIL("dequantize_cuda: kernel launch for rows [", row_begin, ", ", row_end, ") of ", describe(layout),
            " to ", to_string(dtype), " failed: ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ")");
  }
}

}  // namespace quant
}  // namespace layerstream
