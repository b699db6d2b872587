// layerstream — quantized weight formats (torch-free, CUDA-free).
//
// A weight tensor of any rank is viewed as a row-major matrix
// [rows, cols] = [shape[0], prod(shape[1:])] (rows = out_features,
// cols = in_features). pack() turns it into ONE contiguous buffer made of up
// to three sections, each starting at a multiple of 256 bytes:
//
//   [ data | pad | scales | pad | zeros | pad ]      total_bytes() % 256 == 0
//
// Formats (docs/design/quant-formats.md has the exact byte layouts):
//   int8  symmetric per output row: scale = absmax/127 (fp32, [rows]),
//         q = clamp(round_half_even(w/scale), -127, 127) as int8 [rows, cols];
//         w' = float(q) * scale.
//   fp8   e4m3fn per output row: scale = absmax/448 (fp32, [rows]),
//         q = e4m3fn(w/scale) with round-to-nearest-even, saturating at ±448,
//         subnormals included; one byte per element [rows, cols];
//         w' = decode(q) * scale.
//   nf4   4-bit NormalFloat: blocks of 64 consecutive elements of the
//         flattened tensor (the last block may be partial), fp32 absmax per
//         block ([ceil(n/64)]), q = index of the nearest of the 16 NF4 code
//         values to w/absmax (ties to the lower index); two codes per byte,
//         element 2k in the HIGH nibble of byte k (bitsandbytes order);
//         w' = code[q] * absmax.
//   int4  asymmetric, groups of 128 along cols (cols % 128 == 0 required):
//         per group fp32 scale and fp32 zero point ([rows, cols/128] each),
//         range [min(w,0), max(w,0)], scale = range/15,
//         zero = clamp(round_half_even(-min/scale), 0, 15) (an integer kept
//         as fp32), q = clamp(round_half_even(w/scale + zero), 0, 15);
//         two per byte, element 2k of a row in the HIGH nibble;
//         w' = (float(q) - zero) * scale. A group that this gives back
//         inexactly but another scale (on a grid of 15, 14 or 13 steps over
//         the range) gives back bit for bit in the source dtype -- values
//         dequantized from int4, as detach() restores them -- is packed with
//         that one (Note [An int4 group that holds dequantized int4 values],
//         quant.cpp), so quantizing them again changes nothing.
//
// Error bounds (per element, |w - w'|; "slack" covers fp32 rounding of the
// quantizer's own arithmetic, see error_bound()):
//   int8  scale/2          int4  scale/2 (of the element's group)
//   nf4   absmax * kNF4MaxHalfGap (of the element's block)
//   fp8   scale * max(2^-4 * |w/scale|, 2^-10)   (2^-4 relative for normals,
//         2^-10 * scale absolute in the e4m3 subnormal range)
//
// NaN or Inf anywhere in the source makes pack() throw layerstream::Error
// naming the first offending row and column (the destination buffer is then
// unspecified). Packing is multi-threaded over rows (int8/fp8/int4) or blocks
// (nf4) and the output is byte-identical for every thread count (padding
// bytes are always zero).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "slot_layout.h"

namespace layerstream {
namespace quant {

// Int8 .. Int4 are layerstream's own (pack() produces them). The Gguf* formats
// are GGUF's (llama.cpp / ggml) block formats, read as they are from .gguf
// files: layerstream dequantizes them (on the CPU and on the device,
// bit-identical to gguf-py's dequantize) but does not produce them (pack()
// refuses). Byte layouts: gguf_blocks.h and docs/design/quant-formats.md.
enum class Format : uint8_t {
  None = 0, Int8 = 1, Fp8E4M3 = 2, NF4 = 3, Int4 = 4,
  GgufQ8_0 = 5, GgufQ4_0 = 6, GgufQ4_1 = 7, GgufQ5_0 = 8, GgufQ5_1 = 9,
  GgufQ2_K = 10, GgufQ3_K = 11, GgufQ4_K = 12, GgufQ5_K = 13, GgufQ6_K = 14,
  // Lossless (core/lossless.h): entropy-coded exponents, decoded bit for bit
  // into the weight's own dtype. Its coded size depends on the values, so its
  // PackedLayout comes from lossless_layout() (one data section: the coded
  // buffer), never from layout_for().
  Lossless = 15,
};

// True for the GGUF block formats.
inline bool is_gguf(Format f) { return f >= Format::GgufQ8_0 && f <= Format::GgufQ6_K; }

// Element type of an unpacked source or output: fp32, or raw 16-bit bit
// patterns (uint16_t) of bfloat16 / IEEE half.
enum class SrcDtype : uint8_t { F32, BF16, F16 };
enum class OutDtype : uint8_t { F32, BF16, F16 };

// "int8", "fp8" (also "fp8_e4m3", "e4m3"), "nf4", "int4", "none": the
// formats layerstream quantizes to. Throws layerstream::Error listing the valid
// names otherwise (a GGUF name gets a message saying where those come from).
Format parse_format(const std::string& name);
// Any format by its to_string() name, GGUF ones included ("q8_0", "q4_k", ...):
// for weights that arrive packed.
Format parse_packed_format(const std::string& name);
// "int8", "fp8", "nf4", "int4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
// "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "none".
const char* to_string(Format f);
// "f32", "bf16", "f16" (also "float32", "bfloat16", "float16", "fp16", "fp32").
OutDtype parse_out_dtype(const std::string& name);
const char* to_string(OutDtype d);
const char* to_string(SrcDtype d);
size_t out_dtype_bytes(OutDtype d);

// Sections of a packed buffer start on the slot's alignment (slot_layout.h).
constexpr size_t kSectionAlign = slot_layout::kAlign;
constexpr int64_t kNF4BlockSize = 64;
constexpr int64_t kInt4GroupSize = 128;

// The 16 NF4 code values (QLoRA / bitsandbytes), ascending; code 7 is 0.0.
extern const float kNF4Codes[16];
// Largest half-gap between adjacent NF4 codes, between -1.0 and
// -0.6961928009986877: 0.15190359950065613.
constexpr double kNF4MaxHalfGap = (1.0 - 0.6961928009986877) / 2.0;

// The self-description of one packed tensor. All offsets are relative to the
// start of the single packed buffer; each section starts 256-byte aligned.
struct PackedLayout {
  Format format = Format::None;
  int64_t rows = 0, cols = 0;
  // Elements sharing one scale: int8/fp8: cols (one scale per row);
  // nf4: 64 (consecutive flattened elements); int4: 128 (along cols);
  // GGUF: the elements of one block (32 or 256, along cols).
  int64_t block_size = 0;
  size_t data_bytes = 0;   // packed codes (GGUF: the blocks, scales inside)
  size_t scale_bytes = 0;  // fp32 scales (nf4: absmax per block)
  size_t zero_bytes = 0;   // fp32 zero points (int4 only, else 0)

  int64_t numel() const { return rows * cols; }
  // Number of scales (= number of zero points for int4).
  int64_t num_scales() const { return static_cast<int64_t>(scale_bytes / sizeof(float)); }
  size_t data_offset() const { return 0; }
  size_t scale_offset() const { return align_up(data_offset() + data_bytes); }
  size_t zero_offset() const { return align_up(scale_offset() + scale_bytes); }
  // Whole buffer, a multiple of 256 bytes (so packed tensors can be laid out
  // back to back and every section stays aligned).
  size_t total_bytes() const { return align_up(zero_offset() + zero_bytes); }

  static size_t align_up(size_t v) { return round_up(v, kSectionAlign); }
};

// One-line human description, e.g. "nf4 [4096, 4096] block 64: data 8388608 B
// @0, scales 1048576 B @8388608, zeros 0 B @9437184, total 9437184 B".
std::string describe(const PackedLayout& layout);

// Validates the shape (rows, cols >= 0; int4 needs cols % 128 == 0, GGUF
// formats cols % block == 0) with a message naming the shape and the block
// size. Format::None is rejected.
PackedLayout layout_for(Format format, int64_t rows, int64_t cols);
// The layout of a lossless-coded [rows, cols] weight: its coded buffer
// (core/lossless.h, `coded_bytes` long) as the data section.
PackedLayout lossless_layout(int64_t rows, int64_t cols, size_t coded_bytes);
// Bytes a [rows, cols] weight takes packed in `format`: layout_for()'s, or
// for lossless its exact coded size, which needs its values (`src`, of `dtype`).
size_t packed_bytes(Format format, SrcDtype dtype, const void* src, int64_t rows, int64_t cols);

// Quantizes src ([rows, cols] row-major) into dst, which must hold
// layout_for(format, rows, cols).total_bytes() bytes. num_threads 0 = one per
// hardware thread (small tensors use fewer). Throws on NaN/Inf in src, and
// for the GGUF formats (layerstream does not produce them).
void pack(Format format, const float* src, int64_t rows, int64_t cols, void* dst,
          int num_threads = 0);
// Same from raw fp32 / bf16 / fp16 source elements (16-bit ones as uint16_t).
void pack(Format format, const void* src, SrcDtype src_dtype, int64_t rows, int64_t cols,
          void* dst, int num_threads = 0);
inline void pack_bf16(Format format, const uint16_t* src, int64_t rows, int64_t cols, void* dst,
                      int num_threads = 0) {
  pack(format, src, SrcDtype::BF16, rows, cols, dst, num_threads);
}
inline void pack_f16(Format format, const uint16_t* src, int64_t rows, int64_t cols, void* dst,
                     int num_threads = 0) {
  pack(format, src, SrcDtype::F16, rows, cols, dst, num_threads);
}

// Reference dequantization: out holds layout.numel() elements of `dtype`
// (bf16/f16 as uint16_t bit patterns, converted from the fp32 result with
// round-to-nearest-even). The CUDA kernels are bit-identical to this.
void dequantize_cpu(const PackedLayout& layout, const void* packed, void* out, OutDtype dtype,
                    int num_threads = 0);
inline void dequantize_cpu(const PackedLayout& layout, const void* packed, float* out) {
  dequantize_cpu(layout, packed, out, OutDtype::F32, 1);
}

// Where rows [row_begin, row_end) of a packed tensor lie in its buffer (byte
// offsets from the buffer's start; each section's part is contiguous), so that
// a row range, e.g. one expert of an [experts * rows, cols] tensor, can be
// copied on its own and dequantized where it lies (dequantize_rows_*). GGUF
// rows are whole blocks, so any range is one contiguous byte range. nf4
// blocks run across rows: row_begin * cols must be a multiple of 64, and so
// must row_end * cols unless row_end == rows. Throws otherwise.
struct RowRange {
  int64_t row_begin = 0, row_end = 0;
  size_t data_begin = 0, data_bytes = 0;
  size_t scale_begin = 0, scale_bytes = 0;
  size_t zero_begin = 0, zero_bytes = 0;  // int4 only
};
RowRange row_range(const PackedLayout& layout, int64_t row_begin, int64_t row_end);

// dequantize_cpu() of rows [row_begin, row_end) only, read from `packed` (the
// whole tensor's buffer; only the row range's bytes are read): `out` receives
// (row_end - row_begin) * cols elements, bit-identical to those rows of
// dequantize_cpu()'s output. Same row rules as row_range().
void dequantize_rows_cpu(const PackedLayout& layout, const void* packed, int64_t row_begin,
                         int64_t row_end, void* out, OutDtype dtype, int num_threads = 0);

// Allowed |w - w'| for element (row, col) whose original value was w, given
// the packed buffer (which holds the element's scale). Includes a small slack
// for fp32 rounding inside the quantizer: relative 2^-10 of the bound plus
// 2^-140 absolute (relevant only when a scale is subnormal). Throws for the
// GGUF formats (their quantizer is not ours).
double error_bound(const PackedLayout& layout, const void* packed, int64_t row, int64_t col,
                   float w);

// ---- scalar conversions (exposed for tests and other kernels) ----
// fp32 -> e4m3fn, round-to-nearest-even, saturating to ±448 (0x7E / 0xFE);
// NaN -> 0x7F. -0.0 -> 0x80.
uint8_t fp8_e4m3_encode(float x);
// e4m3fn -> fp32 (exact); 0x7F / 0xFF -> NaN.
float fp8_e4m3_decode(uint8_t code);
// fp32 -> bf16 / IEEE half bit patterns, round-to-nearest-even, overflow to
// Inf, half subnormals handled. NaN -> 0x7FFF (the canonical NaN CUDA's
// cvt.rn produces, so CPU and GPU agree bit for bit).
uint16_t float_to_bf16_bits(float x);
uint16_t float_to_f16_bits(float x);
float bf16_bits_to_float(uint16_t b);
float f16_bits_to_float(uint16_t h);

}  // namespace quant
}  // namespace layerstream
