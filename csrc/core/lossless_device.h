// layerstream — lossless weights: the pieces of the decoder that run on a
// GPU, written once for the CUDA kernel (kernels/cuda/lossless.cu) and the
// host (the split below is also the encoder's; tests run the kernel's block
// decoder on the CPU against the reference decoder of lossless.cpp).
//
// Plain C++17 and CUDA: every function is __host__ __device__ under nvcc and
// inline otherwise; no allocation, no exceptions, nothing outside the
// pointers given. The format is docs/design/quant-formats.md ("lossless").
//
// How the kernel uses it: one thread per coded block. A thread block builds
// the 4096-entry decode table in shared memory (canonical() by one thread,
// then table_entry() for every index, in parallel), then each thread calls
// decode_block_at() for its block. The kernel of pieces (decode_pieces_cuda)
// first reads a piece's code lengths (code_length_at) and sections
// (piece_sections) from its header in device memory. Thread safety: all
// functions are pure.
#pragma once

#include <cstdint>
#ifndef __CUDA_ARCH__
#include <cstring>
#endif

#include "lossless.h"

#if defined(__CUDACC__)
#define LS_LL_FN __host__ __device__ __forceinline__
#else
#define LS_LL_FN inline
#endif
#if defined(__CUDA_ARCH__)
#define LS_LL_UNROLL _Pragma("unroll")
#else
#define LS_LL_UNROLL
#endif

namespace layerstream {
namespace lossless {
namespace device {

// ---- the element split (join(sym(v), raw(v), low(v)) == v) ----
// bf16: symbol = exponent, raw = sign | mantissa.
struct Bf16 {
  using T = uint16_t;
  static LS_LL_FN uint8_t sym(T v) { return static_cast<uint8_t>(v >> 7); }
  static LS_LL_FN uint8_t raw(T v) { return static_cast<uint8_t>(((v >> 8) & 0x80) | (v & 0x7F)); }
  static LS_LL_FN T join(uint32_t s, uint32_t r, uint32_t) {
    return static_cast<T>(((r & 0x80) << 8) | ((s & 0xFF) << 7) | (r & 0x7F));
  }
};
// f16: symbol = high byte (sign, exponent, top 2 mantissa bits), raw = low byte.
struct F16 {
  using T = uint16_t;
  static LS_LL_FN uint8_t sym(T v) { return static_cast<uint8_t>(v >> 8); }
  static LS_LL_FN uint8_t raw(T v) { return static_cast<uint8_t>(v); }
  static LS_LL_FN T join(uint32_t s, uint32_t r, uint32_t) { return static_cast<T>(((s & 0xFF) << 8) | (r & 0xFF)); }
};
// f32: the high half as bf16, the low half kept.
struct F32 {
  using T = uint32_t;
  static LS_LL_FN uint8_t sym(T v) { return Bf16::sym(static_cast<uint16_t>(v >> 16)); }
  static LS_LL_FN uint8_t raw(T v) { return Bf16::raw(static_cast<uint16_t>(v >> 16)); }
  static LS_LL_FN uint16_t low(T v) { return static_cast<uint16_t>(v); }
  static LS_LL_FN T join(uint32_t s, uint32_t r, uint32_t lo) { return (T{Bf16::join(s, r, 0)} << 16) | (lo & 0xFFFF); }
};

// ---- loads and stores (aligned vectors on the device, memcpy on the host) ----
LS_LL_FN uint64_t load_u64(const void* p) {  // 8-byte aligned on the device
#ifdef __CUDA_ARCH__
  return *static_cast<const uint64_t*>(p);
#else
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
LS_LL_FN uint32_t load_u32(const void* p) {  // 4-byte aligned on the device
#ifdef __CUDA_ARCH__
  return *static_cast<const uint32_t*>(p);
#else
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
LS_LL_FN void store_16_bytes(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {  // 16-byte aligned
#ifdef __CUDA_ARCH__
  *static_cast<uint4*>(p) = make_uint4(a, b, c, d);
#else
  const uint32_t v[4] = {a, b, c, d};
  std::memcpy(p, v, sizeof v);
#endif
}

// ---- the decode table ----
constexpr int kTableBits = kMaxCodeLength;
constexpr uint32_t kTableSize = 1u << kTableBits;
// Entry bits: 0-3 the stream bits the entry's symbols take, kTwo if it holds
// two symbols, kNoCode if no code starts with these bits (it then takes 0
// bits), 8-15 the first symbol, 16-23 the second.
constexpr uint32_t kTwo = 1u << 4, kNoCode = 1u << 5;

// The canonical code (DEFLATE's rule) of 256 code lengths, in the form the
// table needs: the codes of length l are next[l] .. next[l] + count[l] - 1,
// given to the symbols by_code[start[l] ..] in increasing symbol order.
struct Canonical {
  uint32_t next[kMaxCodeLength + 1];
  uint32_t count[kMaxCodeLength + 1];
  uint32_t start[kMaxCodeLength + 1];
  uint8_t by_code[256];
};

// The lengths must be a valid code (read_header() checked them).
LS_LL_FN void canonical(const uint8_t* len, Canonical* c) {
  for (int l = 0; l <= kMaxCodeLength; ++l) c->count[l] = 0;
  for (int s = 0; s < 256; ++s)
    if (len[s] != 0 && len[s] <= kMaxCodeLength) ++c->count[len[s]];
  uint32_t code = 0, first = 0, pos[kMaxCodeLength + 1];
  c->next[0] = c->start[0] = pos[0] = 0;
  for (int l = 1; l <= kMaxCodeLength; ++l) {
    code = (code + (l > 1 ? c->count[l - 1] : 0)) << 1;
    first += l > 1 ? c->count[l - 1] : 0;
    c->next[l] = code;
    c->start[l] = pos[l] = first;
  }
  for (int s = 0; s < 256; ++s)
    if (len[s] != 0 && len[s] <= kMaxCodeLength) c->by_code[pos[len[s]]++] = static_cast<uint8_t>(s);
}

// symbol << 4 | length of the code the 12 bits `i` start with; 0: none.
LS_LL_FN uint32_t one_entry(const Canonical& c, uint32_t i) {
  for (int l = 1; l <= kMaxCodeLength; ++l) {
    const uint32_t v = i >> (kTableBits - l);
    if (v >= c.next[l] && v - c.next[l] < c.count[l]) return uint32_t{c.by_code[c.start[l] + v - c.next[l]]} << 4 | l;
  }
  return 0;
}

// Table entry i: one symbol, or two when the second code also ends within
// the 12 bits (a prefix code: whatever bits follow, it is the same code).
LS_LL_FN uint32_t table_entry(const Canonical& c, uint32_t i) {
  const uint32_t a = one_entry(c, i), la = a & 15;
  if (la == 0) return kNoCode;
  const uint32_t b = one_entry(c, (i << la) & (kTableSize - 1)), lb = b & 15;
  if (lb != 0 && la + lb <= static_cast<uint32_t>(kTableBits)) return (b >> 4) << 16 | (a >> 4) << 8 | kTwo | (la + lb);
  return (a >> 4) << 8 | la;
}

// ---- one block ----
// Writes 8 elements at `out` from 8 symbols (byte k of `syms` is element
// k's) and their raw bytes (and low halves); out 16-byte aligned, raw 8, low 16.
template <class S>
LS_LL_FN void put8(uint64_t syms, const uint8_t* raw, const uint16_t* low, typename S::T* out) {
  const uint64_t r = load_u64(raw);
  if constexpr (sizeof(typename S::T) == 2) {
    uint32_t v[4];
LS_LL_UNROLL
    for (int q = 0; q < 4; ++q) {
      const int a = 16 * q, b = a + 8;
      v[q] = uint32_t{S::join(uint32_t(syms >> a), uint32_t(r >> a), 0)} |
             uint32_t{S::join(uint32_t(syms >> b), uint32_t(r >> b), 0)} << 16;
    }
    store_16_bytes(out, v[0], v[1], v[2], v[3]);
  } else {
    uint32_t v[8];
LS_LL_UNROLL
    for (int k = 0; k < 8; ++k) {
      const uint32_t lo = load_u32(low + 2 * (k / 2)) >> (16 * (k % 2));
      v[k] = S::join(uint32_t(syms >> (8 * k)), uint32_t(r >> (8 * k)), lo);
    }
    store_16_bytes(out, v[0], v[1], v[2], v[3]);
    store_16_bytes(out + 4, v[4], v[5], v[6], v[7]);
  }
}

// Decodes the n elements of one block from its num_words stream words
// (4-byte aligned), its raw bytes and (f32) low halves into out, with the
// table of table_entry() and the code lengths. Reads only words[0,
// num_words), raw[0, n), low[0, n) and writes out[0, n). Returns false when
// the block is corrupt (a pattern that is no code, or codes that do not
// fill exactly its words with zero padding); out then holds garbage.
template <class S>
LS_LL_FN bool decode_block(const uint32_t* table, const uint8_t* len, const uint32_t* words, uint64_t num_words,
                           const uint8_t* raw, const uint16_t* low, typename S::T* out, int64_t n) {
  uint64_t win = 0, w = 0;  // window: the next `have` stream bits, MSB first
  int have = 0;
  uint32_t bad = 0;
  uint64_t syms = 0;  // decoded symbols not yet written (k of them, byte k is the k-th)
  int k = 0;
  int64_t i = 0, j = 0;  // symbols decoded, elements written
  while (i < n) {
    if (have < kMaxCodeLength) {
      const uint64_t x = w < num_words ? load_u32(words + w) : 0;  // zeros past the end
      ++w;
      win |= x << (32 - have);
      have += 32;
    }
    const uint32_t e = table[win >> (64 - kTableBits)];
    bad |= e & kNoCode;
    uint32_t l = e & 15, two = (e & kTwo) != 0;
    if (two && i + 1 == n) {  // the last symbol alone
      two = 0;
      l = (e & kNoCode) ? 0 : len[(e >> 8) & 0xFF];
    }
    win <<= l;
    have -= static_cast<int>(l);
    syms |= uint64_t((e >> 8) & (two ? 0xFFFFu : 0xFFu)) << (8 * k);  // a second symbol at k == 7 is lost here...
    k += 1 + static_cast<int>(two);
    i += 1 + static_cast<int>(two);
    if (k >= 8) {
      put8<S>(syms, raw + j, low ? low + j : nullptr, out + j);
      j += 8;
      k -= 8;
      syms = k ? (e >> 16) & 0xFF : 0;  // ...and kept here
    }
  }
  for (int t = 0; t < k; ++t, ++j)
    out[j] = S::join(uint32_t(syms >> (8 * t)), raw[j], low ? low[j] : 0);
  const uint64_t used_bits = 32 * w - static_cast<uint64_t>(have);
  return !bad && (used_bits + 31) / 32 == num_words && win == 0;
}

// Where the sections of a coded buffer lie (from its Header).
struct Sections {
  const uint8_t* base = nullptr;  // the coded buffer, 16-byte aligned on the device
  uint64_t offsets_offset = 0, raw_offset = 0, low16_offset = 0, stream_offset = 0, stream_words = 0;
  int64_t numel = 0, block_elems = 0, num_blocks = 0;
};

inline Sections sections_of(const Layout& L, const void* base) {
  Sections s;
  s.base = static_cast<const uint8_t*>(base);
  s.offsets_offset = L.offsets_offset();
  s.raw_offset = L.raw_offset();
  s.low16_offset = L.low16_offset();
  s.stream_offset = L.stream_offset();
  s.stream_words = L.stream_words;
  s.numel = L.numel;
  s.block_elems = L.block_elems;
  s.num_blocks = L.num_blocks;
  return s;
}

// ---- pieces (analyze_pieces): what the GPU reads from each piece's header ----
// Code length of symbol s from a header's 4-bit fields (symbol 2k in the high
// nibble of byte k); read_header() reads them so too.
LS_LL_FN uint8_t code_length_at(const uint8_t* header, int s) {
  const uint8_t b = header[kHeaderCodeLengthsAt + s / 2];
  return static_cast<uint8_t>(s % 2 ? b & 15 : b >> 4);
}

// One piece to decode: where its coded buffer starts in the coded bytes and
// where its elements go in the output (byte offsets; both 16-byte aligned).
struct PieceJob {
  uint64_t coded_offset = 0, out_offset = 0;
};

// The sections of the piece at `piece` (its header, 16-byte aligned), from
// `shared`: sections_of() any piece of the same tensor with base nullptr.
// Pieces with equal element counts share every section offset; only the
// stream's length differs, read here from the piece's header.
LS_LL_FN Sections piece_sections(const Sections& shared, const uint8_t* piece) {
  Sections s = shared;
  s.base = piece;
  s.stream_words = load_u64(piece + kHeaderStreamWordsAt);
  return s;
}

// Decodes block b (0 <= b < num_blocks) of the buffer into out (the whole
// tensor's output, 16-byte aligned). A block whose offsets run outside the
// stream reads no words (and reports corruption) rather than read outside.
template <class S>
LS_LL_FN bool decode_block_at(const Sections& s, const uint32_t* table, const uint8_t* len, int64_t b,
                              typename S::T* out) {
  const uint8_t* offsets = s.base + s.offsets_offset;
  uint64_t w0 = load_u64(offsets + 8 * b), w1 = load_u64(offsets + 8 * (b + 1));
  const bool in_stream = w0 <= w1 && w1 <= s.stream_words;
  if (!in_stream) w0 = w1 = 0;
  const int64_t start = b * s.block_elems;
  const int64_t n = s.numel - start < s.block_elems ? s.numel - start : s.block_elems;
  const uint16_t* low = sizeof(typename S::T) == 4
                            ? reinterpret_cast<const uint16_t*>(s.base + s.low16_offset) + start
                            : nullptr;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(s.base + s.stream_offset) + w0;
  return decode_block<S>(table, len, words, w1 - w0, s.base + s.raw_offset + start, low, out + start, n) &&
         in_stream;
}

}  // namespace device
}  // namespace lossless
}  // namespace layerstream
