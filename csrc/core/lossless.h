// layerstream — lossless weights: floating-point tensors entropy-coded on the
// host and decoded bit for bit (issue 28; torch-free, CUDA-free).
//
// Every element is split into a *symbol* byte, coded with a canonical Huffman
// code of at most 12 bits per symbol, and raw bits kept as they are:
//   bf16  symbol = the 8 exponent bits          raw byte = sign << 7 | 7-bit mantissa
//   f16   symbol = the high byte (sign, 5 exponent bits, top 2 mantissa bits)
//         raw byte = the low byte (low 8 mantissa bits)
//   f32   the high half is coded as a bf16 element; the low 16 mantissa bits
//         are kept as a uint16 (its own section)
// Weights' exponents carry ~2.6 bits of information, so bf16 weights cost
// ~10.6 bits per element; a tensor never costs more than its raw size plus
// 12 bytes per block and 1300 bytes (an 8-bit fixed code is one of the codes
// the length-limited optimum is chosen from; max_encoded_bytes()).
//
// The coded tensor is ONE contiguous, self-describing buffer (little-endian),
// every section 256-byte aligned and all padding zero:
//   [ header 256 B | block offsets | raw bytes | low16 (f32) | bit stream ]
// The elements are cut into blocks of block_elems (a power of two); each
// block's codes start on a 32-bit word of the stream whose index the offsets
// section records, so blocks decode independently (CPU threads; one GPU
// thread per block). Within a little-endian uint32 word the first code bit is
// the most significant. docs/design/quant-formats.md ("lossless") has the
// exact layout and the canonical code rule a GPU decoder must follow.
//
// Ownership: functions read and write only the caller's buffers. Thread
// safety: all functions are pure; encode/decode may run concurrently on
// different buffers. Output is byte-identical for every thread count.
// Threads: num_threads (0: one per hardware thread, at least 2^17 elements
// each) of the process-wide pool, optim::ThreadPool::shared(), at most its
// size; concurrent calls take turns on it. Do not call from one of its tasks.
// Errors (bad arguments, a buffer too small, a corrupt or truncated coded
// buffer) throw layerstream::Error naming what is wrong; decoding validates
// everything it reads and never reads or writes outside the given buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "quant.h"

namespace layerstream {
namespace lossless {

using Dtype = quant::SrcDtype;  // F32, BF16, F16 (16-bit ones as raw uint16_t)

constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 256;
constexpr int kMaxCodeLength = 12;        // bits; a 4096-entry table decodes one symbol
constexpr int64_t kMinBlockElems = 64, kMaxBlockElems = int64_t{1} << 20;
// The block size when none is given (block_elems 0 below): the power of two
// nearest below numel / 32768, within [512, 4096], so that a tensor of 16M
// elements or more has some 32768 blocks. The CUDA decoder walks a block on
// one thread, and a thread's time grows with its block, not with the tensor:
// on the H200 a 16384 x 4096 weight in 4096-element blocks took 1.37 ms
// (run 5), and a 4096 x 4096 one would take about as long while its coded
// copy takes 0.4 ms. Smaller blocks cost offsets and padding (bf16 N(0, 0.02):
// 0.6635 of raw at 4096, 0.6720 at 512). docs/design/quant-formats.md, "The
// CUDA decoder".
constexpr int64_t kDefaultBlockElemsMin = 512, kDefaultBlockElemsMax = 4096;
int64_t default_block_elems(int64_t numel);
constexpr int64_t kMaxNumel = int64_t{1} << 56;
// Zero bytes guaranteed after the last stream word (vector loads may run over).
constexpr size_t kStreamTailBytes = 16;
// Where two header fields lie (docs/design/quant-formats.md, the header
// table), which the GPU decoder of pieces also reads from the device copy:
// stream_words (uint64) and the code lengths (4 bits per symbol).
constexpr size_t kHeaderStreamWordsAt = 32, kHeaderCodeLengthsAt = 64;

size_t element_bytes(Dtype d);

// Where the sections of a coded buffer lie (byte offsets from its start).
struct Layout {
  Dtype dtype = Dtype::BF16;
  int64_t numel = 0;
  int64_t block_elems = 0;    // a power of two in [kMinBlockElems, kMaxBlockElems]
  int64_t num_blocks = 0;     // ceil(numel / block_elems)
  uint64_t stream_words = 0;  // uint32 words of the bit stream

  // uint64[num_blocks + 1]: block b's words are [offsets[b], offsets[b + 1]).
  size_t offsets_offset() const { return kHeaderBytes; }
  size_t raw_offset() const { return align(offsets_offset() + 8 * size_t(num_blocks + 1)); }
  size_t low16_offset() const { return align(raw_offset() + size_t(numel)); }
  size_t low16_bytes() const { return dtype == Dtype::F32 ? 2 * size_t(numel) : 0; }
  size_t stream_offset() const { return align(low16_offset() + low16_bytes()); }
  size_t total_bytes() const { return align(stream_offset() + 4 * stream_words + kStreamTailBytes); }
  static size_t align(size_t v) { return quant::PackedLayout::align_up(v); }
};

// The parsed header of a coded buffer.
struct Header {
  Layout layout;
  int max_code_length = 0;  // 1..12 (0 for an empty tensor)
  uint8_t code_lengths[256] = {};  // per symbol, 0 = not used
};

// Length-limited (<= 12 bits) optimal prefix code lengths for the symbol
// frequencies (package-merge). Unused symbols get 0; a single used symbol
// gets length 1. Deterministic. Exposed for tests and estimates.
void code_lengths(const uint64_t freq[256], uint8_t lengths[256]);

// The analysis of one tensor: its code and where every block goes. Made by
// analyze(), consumed by encode() with the same source.
struct Analysis {
  Layout layout;
  uint8_t code_lengths[256] = {};
  std::vector<uint64_t> block_offsets;  // num_blocks + 1 word offsets
  size_t total_bytes() const { return layout.total_bytes(); }
};

// Histogram, code and per-block sizes of src (numel elements of dtype):
// the exact coded size is analysis.total_bytes(). num_threads 0 = automatic;
// block_elems 0 = default_block_elems(numel), here and below.
// One pass over src; temporary memory: 256 counts per block, freed on return
// (512 bytes a block of up to 2^15 elements: half a bf16 tensor's bytes at
// 512-element blocks, 1/16 at 4096).
Analysis analyze(Dtype dtype, const void* src, int64_t numel, int num_threads = 0,
                 int64_t block_elems = 0);
// Writes the coded buffer of src (the source analyze() saw; throws if it
// changed) into dst, which holds dst_bytes >= analysis.total_bytes().
void encode(const Analysis& analysis, const void* src, void* dst, size_t dst_bytes,
            int num_threads = 0);
// Both steps, into a new buffer of exactly the coded size.
std::vector<uint8_t> encode(Dtype dtype, const void* src, int64_t numel, int num_threads = 0,
                            int64_t block_elems = 0);

// Reads and validates the header and the block offsets of a coded buffer of
// `bytes` bytes (which may exceed the coded size): throws naming the first
// problem (magic, version, dtype, sizes, code lengths, offsets, truncation).
Header read_header(const void* encoded, size_t bytes);
// Decodes into dst (dst_bytes >= numel * element size): bit-identical to the
// encoded source. Throws on any corruption (the content of dst is then
// unspecified, nothing outside it is written).
void decode(const void* encoded, size_t bytes, void* dst, size_t dst_bytes, int num_threads = 0);

// The largest coded size of any tensor of this dtype and size (for sizing
// buffers before the data is known, e.g. after a weight update).
size_t max_encoded_bytes(Dtype dtype, int64_t numel, int64_t block_elems = 0);
// A cheap sign that a buffer's bytes changed: a hash of its size and of up
// to `samples` 8-byte words spread evenly over it (every word of a buffer of
// at most 8 * samples bytes; a partial last word included). A change that
// touches none of the sampled words goes unseen. Pure; any alignment.
uint64_t sample_fingerprint(const void* data, size_t bytes, size_t samples = 1024);
// Predicted coded size of a numel-element tensor from a sample of its
// elements (sample_numel >= 1; e.g. strided elements read from a checkpoint):
// the sample's code applied to numel elements, each block's word padding
// counted in full (so the estimate leans high).
size_t estimate_encoded_bytes(Dtype dtype, const void* sample, int64_t sample_numel,
                              int64_t numel, int64_t block_elems = 0);

// ---- pieces: one tensor coded as several buffers ----
// A mixture-of-experts tensor [experts, ...] is coded one expert at a time,
// so that the experts a router chose cross the bus and decode alone: its
// `count` pieces of numel / count elements are coded each with its own code
// and block offsets, their buffers back to back (each a multiple of 256
// bytes long, so every piece starts as aligned as the first).
// docs/design/quant-formats.md, "Pieces".
//
// How many pieces a tensor of `numel` elements whose dim 0 is `dim0` is
// coded in when streamed with `experts` experts: `experts` when dim 0 is the
// experts (dim0 == experts > 1, numel a multiple of it) and each piece's
// decoded bytes are a multiple of 16 (the CUDA decoder writes 16 bytes at a
// time, so every piece's output must start 16-byte aligned); else 1 (the
// whole tensor, which is then fetched whole).
int64_t expert_pieces(Dtype dtype, int64_t numel, int64_t dim0, int64_t experts);
// The analyses of the `count` pieces of src (count >= 1 divides numel) and
// where each piece's buffer starts: offsets[k], offsets[count] = the total.
struct PiecesAnalysis {
  std::vector<Analysis> pieces;
  std::vector<size_t> offsets;
  size_t total_bytes() const { return offsets.empty() ? 0 : offsets.back(); }
};
PiecesAnalysis analyze_pieces(Dtype dtype, const void* src, int64_t numel, int64_t count, int num_threads = 0);
// The largest total of `count` pieces (count >= 1 divides numel): each
// piece's max_encoded_bytes, back to back (a trainable group tensor's coded
// buffer, whose values change).
size_t max_pieces_bytes(Dtype dtype, int64_t numel, int64_t count);
// Writes every piece (encode() of each) into dst (dst_bytes >= the total).
void encode_pieces(const PiecesAnalysis& analysis, const void* src, void* dst, size_t dst_bytes,
                   int num_threads = 0);

}  // namespace lossless
}  // namespace layerstream
