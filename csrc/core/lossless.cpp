// layerstream — lossless weights: the codec. See lossless.h and
// docs/design/quant-formats.md ("lossless").
#include "lossless.h"
#include "lossless_device.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "error.h"
#include "optim/thread_pool.h"

namespace layerstream {
namespace lossless {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the coded format is read and written as little-endian");

namespace {

constexpr char kMagic[4] = {'L', 'S', 'L', 'L'};
constexpr int kTableBits = kMaxCodeLength;  // decode table: 2^12 entries

// ---- element split (lossless_device.h, shared with the GPU decoder) ----
using device::Bf16;
using device::F16;
using device::F32;

// Calls fn(Split{}) with the split of dtype d.
template <class Fn>
void with_split(Dtype d, const Fn& fn) {
  switch (d) {
    case Dtype::BF16: fn(Bf16{}); return;
    case Dtype::F16: fn(F16{}); return;
    case Dtype::F32: fn(F32{}); return;
  }
  LS_FAIL("lossless: unknown dtype ", static_cast<int>(d));
}

template <class T>
T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(void* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
// Element i of a source (which may be unaligned, e.g. in a mapped file).
template <class S>
typename S::T elem(const void* src, int64_t i) {
  return load<typename S::T>(static_cast<const uint8_t*>(src) + sizeof(typename S::T) * size_t(i));
}

// The dtype code stored in the header.
uint8_t dtype_code(Dtype d) { return d == Dtype::BF16 ? 1 : d == Dtype::F16 ? 2 : 3; }

// ---- threads ----
// num_threads 0: one per hardware thread, at least 2^17 elements each.
int resolve_threads(int num_threads, int64_t numel) {
  if (num_threads > 0) return std::min(num_threads, 1024);
  const int64_t hw = std::max<unsigned>(1, std::thread::hardware_concurrency());
  return static_cast<int>(std::clamp<int64_t>(numel >> 17, 1, std::min<int64_t>(hw, 256)));
}

// Runs fn(task, begin, end) over [0, units) cut into `tasks` contiguous
// ranges, on up to `threads` threads of the process-wide pool (persistent
// workers: a weight re-coded every step does not start threads every time).
// Exceptions: the lowest range's is rethrown.
template <class Fn>
void for_ranges(int64_t units, int64_t tasks, int threads, const Fn& fn) {
  tasks = std::clamp<int64_t>(tasks, 1, std::max<int64_t>(units, 1));
  const int64_t per = units / tasks, extra = units % tasks;
  const auto range = [&](int64_t t) {
    fn(t, per * t + std::min(t, extra), per * (t + 1) + std::min(t + 1, extra));
  };
  optim::ThreadPool& pool = optim::ThreadPool::shared();
  const int64_t lanes = std::min<int64_t>({threads, tasks, pool.threads()});
  if (lanes <= 1) {
    for (int64_t t = 0; t < tasks; ++t) range(t);
    return;
  }
  // `lanes` pool tasks take ranges in turn, so that at most `threads` run at once.
  std::atomic<int64_t> next{0};
  std::mutex mu;
  int64_t failed = tasks;
  std::exception_ptr error;
  pool.run(lanes, [&](int64_t) {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      try {
        range(t);
      } catch (...) {
        std::lock_guard<std::mutex> g(mu);
        if (t < failed) {
          failed = t;
          error = std::current_exception();
        }
      }
    }
  });
  if (error) std::rethrow_exception(error);
}

// Block ranges per thread: a few each, so that a slow thread does not hold up the rest.
int64_t block_tasks(int threads) { return threads <= 1 ? 1 : 4 * int64_t{threads}; }

// ---- the code ----
// True if the lengths are a code the format allows: no length over 12, and
// a complete prefix code (Kraft sum 1), a single symbol of length 1, or none.
bool valid_lengths(const uint8_t len[256]) {
  uint32_t kraft = 0, used = 0;  // kraft in units of 2^-12
  for (int s = 0; s < 256; ++s) {
    if (len[s] == 0) continue;
    if (len[s] > kMaxCodeLength) return false;
    kraft += 1u << (kMaxCodeLength - len[s]);
    ++used;
  }
  return kraft == (1u << kMaxCodeLength) || used == 0 || (used == 1 && kraft == (1u << (kMaxCodeLength - 1)));
}

// Canonical codes of DEFLATE (RFC 1951, 3.2.2): shorter codes first, within a
// length by symbol. The lengths must be valid_lengths().
void canonical_codes(const uint8_t len[256], uint16_t code[256]) {
  uint32_t count[kMaxCodeLength + 1] = {}, next[kMaxCodeLength + 1] = {};
  for (int s = 0; s < 256; ++s) ++count[len[s]];
  count[0] = 0;
  uint32_t c = 0;
  for (int l = 1; l <= kMaxCodeLength; ++l) {
    c = (c + count[l - 1]) << 1;
    next[l] = c;
  }
  for (int s = 0; s < 256; ++s) code[s] = len[s] ? static_cast<uint16_t>(next[len[s]]++) : 0;
}

// Encode table: code << 4 | length per symbol (0: the symbol has no code).
std::array<uint32_t, 256> encode_table(const uint8_t len[256]) {
  uint16_t code[256];
  canonical_codes(len, code);
  std::array<uint32_t, 256> enc{};
  for (int s = 0; s < 256; ++s) enc[size_t(s)] = uint32_t{code[s]} << 4 | len[s];
  return enc;
}

// Decode table: the next 12 stream bits index it, and an entry decodes one or
// two symbols: bits 0-3 the bits they take, kTwo if two, kNoCode if no code
// starts with these bits (then it takes 0 bits), bits 8-15 the first symbol,
// bits 16-23 the second.
constexpr uint32_t kTwo = 1u << 4, kNoCode = 1u << 5;
std::vector<uint32_t> decode_table(const uint8_t len[256]) {
  uint16_t code[256];
  canonical_codes(len, code);
  std::vector<uint16_t> one(size_t{1} << kTableBits, 0);  // symbol << 4 | length; 0: no code
  for (int s = 0; s < 256; ++s) {
    if (len[s] == 0) continue;
    const uint32_t shift = kTableBits - len[s];
    const uint32_t first = uint32_t{code[s]} << shift;
    std::fill(one.begin() + first, one.begin() + first + (1u << shift), static_cast<uint16_t>(s << 4 | len[s]));
  }
  std::vector<uint32_t> table(one.size());
  for (uint32_t i = 0; i < one.size(); ++i) {
    const uint32_t a = one[i], la = a & 15;
    // The second code is known when it ends within the 12 bits (a prefix code:
    // whatever bits follow, the lookup of the rest finds the same code).
    const uint32_t b = one[(i << la) & (one.size() - 1)], lb = b & 15;
    if (la == 0)
      table[i] = kNoCode;
    else if (lb != 0 && la + lb <= kTableBits)
      table[i] = (b >> 4) << 16 | (a >> 4) << 8 | kTwo | (la + lb);
    else
      table[i] = (a >> 4) << 8 | la;
  }
  return table;
}

using Histogram = std::array<uint64_t, 256>;

// Four interleaved tables of symbol counts: repeated symbols do not wait on
// each other's stores.
using Counts = uint32_t[4][256];

// Adds the symbols of the n elements at src to h (n < 2^32 per table).
template <class S>
void count_symbols(const uint8_t* src, int64_t n, Counts& h) {
  using T = typename S::T;
  int64_t i = 0;
  if constexpr (sizeof(T) == 2) {  // four elements a load
    for (; i + 4 <= n; i += 4) {
      const uint64_t x = load<uint64_t>(src + 2 * i);
      ++h[0][S::sym(static_cast<T>(x))];
      ++h[1][S::sym(static_cast<T>(x >> 16))];
      ++h[2][S::sym(static_cast<T>(x >> 32))];
      ++h[3][S::sym(static_cast<T>(x >> 48))];
    }
  } else {
    for (; i + 4 <= n; i += 4) {
      const uint64_t x = load<uint64_t>(src + 4 * i), y = load<uint64_t>(src + 4 * i + 8);
      ++h[0][S::sym(static_cast<T>(x))];
      ++h[1][S::sym(static_cast<T>(x >> 32))];
      ++h[2][S::sym(static_cast<T>(y))];
      ++h[3][S::sym(static_cast<T>(y >> 32))];
    }
  }
  for (; i < n; ++i) ++h[0][S::sym(elem<S>(src, i))];
}

// Each block's symbol counts (C: uint16_t when a block has at most 2^15
// elements, else uint32_t) and, into `total`, the tensor's.
template <class S, class C>
std::vector<C> block_histograms(const void* src, const Layout& L, int threads, Histogram& total) {
  std::vector<C> counts(static_cast<size_t>(L.num_blocks) * 256);
  const int64_t tasks = block_tasks(threads);
  std::vector<Histogram> parts(static_cast<size_t>(std::max<int64_t>(tasks, 1)), Histogram{});
  for_ranges(L.num_blocks, tasks, threads, [&](int64_t t, int64_t b0, int64_t b1) {
    Counts h;
    Histogram& part = parts[static_cast<size_t>(t)];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * L.block_elems, n = std::min(L.numel, i0 + L.block_elems) - i0;
      std::memset(h, 0, sizeof h);
      count_symbols<S>(static_cast<const uint8_t*>(src) + sizeof(typename S::T) * size_t(i0), n, h);
      C* out = counts.data() + 256 * size_t(b);
      for (int s = 0; s < 256; ++s) {
        const uint32_t c = h[0][s] + h[1][s] + h[2][s] + h[3][s];
        out[s] = static_cast<C>(c);
        part[static_cast<size_t>(s)] += c;
      }
    }
  });
  total = Histogram{};
  for (const Histogram& p : parts)
    for (int s = 0; s < 256; ++s) total[static_cast<size_t>(s)] += p[static_cast<size_t>(s)];
  return counts;
}

}  // namespace

int64_t default_block_elems(int64_t numel) {
  int64_t b = kDefaultBlockElemsMin;
  while (b < kDefaultBlockElemsMax && 2 * b <= numel / 32768) b *= 2;
  return b;
}

namespace {

void check_block_elems(int64_t block_elems) {
  LS_CHECK(block_elems >= kMinBlockElems && block_elems <= kMaxBlockElems &&
               (block_elems & (block_elems - 1)) == 0,
           "lossless: the block size must be a power of two in [", kMinBlockElems, ", ",
           kMaxBlockElems, "], got ", block_elems);
}

// block_elems 0: default_block_elems(numel).
Layout make_layout(Dtype dtype, int64_t numel, int64_t block_elems) {
  LS_CHECK(dtype == Dtype::BF16 || dtype == Dtype::F16 || dtype == Dtype::F32, "lossless: unknown dtype ",
           static_cast<int>(dtype));
  LS_CHECK(numel >= 0 && numel <= kMaxNumel, "lossless: cannot code ", numel,
           " elements (0 to 2^56 are accepted)");
  if (block_elems == 0) block_elems = default_block_elems(numel);
  check_block_elems(block_elems);
  Layout L;
  L.dtype = dtype;
  L.numel = numel;
  L.block_elems = block_elems;
  L.num_blocks = (numel + block_elems - 1) / block_elems;
  return L;
}

// Words of a block of n elements whose codes total `bits`.
uint64_t words_for(uint64_t bits) { return (bits + 31) / 32; }

// ---- one block ----
// Codes the n elements of src into `words` (room for words[-1] to
// words[words_for(12 n)]: see the loop), their raw bytes into raw and (f32)
// low halves into low.
// Returns the number of words; sets *missing if a symbol has no code.
template <class S>
uint64_t encode_block(const uint8_t* src, int64_t n, const uint32_t* enc, uint8_t* raw, uint8_t* low,
                      uint32_t* words, bool* missing) {
  // acc holds the last 64 bits written, pos counts them all. After each
  // append the word that ends at the last 32-bit boundary is stored again
  // (the same value unless the append crossed it): no branch, no carry of
  // pending bits. words[-1] takes the stores before the first boundary.
  uint64_t acc = 0, pos = 0;
  uint32_t none = 0;
  const auto put = [&](uint64_t code, uint32_t bits) {  // bits <= 32
    acc = (acc << bits) | code;
    pos += bits;
    words[static_cast<int64_t>(pos >> 5) - 1] = static_cast<uint32_t>(acc >> (pos & 31));
  };
  // Two codes at a time (at most 24 bits): half the serial shifts. An entry
  // is 0 only for a symbol without a code, so (e - 1) sets bit 31 for those.
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const uint32_t e0 = enc[S::sym(elem<S>(src, i))], e1 = enc[S::sym(elem<S>(src, i + 1))];
    none |= (e0 - 1) | (e1 - 1);
    const uint32_t l1 = e1 & 15;
    put(uint64_t{e0 >> 4} << l1 | (e1 >> 4), (e0 & 15) + l1);
  }
  if (i < n) {
    const uint32_t e = enc[S::sym(elem<S>(src, i))];
    none |= e - 1;
    put(e >> 4, e & 15);
  }
  const uint32_t have = pos & 31;
  if (have > 0) words[pos >> 5] = static_cast<uint32_t>(acc << (32 - have));
  const uint64_t w = (pos + 31) >> 5;
  // The raw sections apart from the serial loop, where they vectorize.
  for (int64_t k = 0; k < n; ++k) raw[k] = S::raw(elem<S>(src, k));
  if constexpr (sizeof(typename S::T) == 4)
    for (int64_t k = 0; k < n; ++k) store(low + 2 * k, S::low(elem<S>(src, k)));
  *missing = (none >> 31) != 0;
  return w;
}

template <class S>
void decode_block(const uint8_t* words, uint64_t num_words, const uint32_t* table, const uint8_t* len,
                  const uint8_t* raw, const uint8_t* low, uint8_t* out, int64_t n, int64_t block) {
  using T = typename S::T;
  uint64_t win = 0, w = 0;  // window: the next `have` stream bits, MSB first
  int have = 0;
  uint32_t bad = 0;
  const auto refill = [&] {
    if (have < kMaxCodeLength) {
      const uint64_t x = w < num_words ? load<uint32_t>(words + 4 * w) : 0;  // zeros past the end
      ++w;
      win |= x << (32 - have);
      have += 32;
    }
  };
  const auto put = [&](int64_t i, uint32_t sym) {
    uint16_t lo = 0;
    if constexpr (sizeof(T) == 4) lo = load<uint16_t>(low + 2 * i);
    store(out + sizeof(T) * size_t(i), S::join(static_cast<uint8_t>(sym), raw[i], lo));
  };
  int64_t i = 0;
  while (i + 1 < n) {  // one or two symbols a lookup
    refill();
    const uint32_t e = table[win >> (64 - kTableBits)];
    put(i, e >> 8);
    put(i + 1, e >> 16);  // rewritten next time if only one symbol was decoded
    bad |= e & kNoCode;
    win <<= e & 15;
    have -= static_cast<int>(e & 15);
    i += (e & kTwo) ? 2 : 1;
  }
  if (i < n) {  // the last symbol alone
    refill();
    const uint32_t e = table[win >> (64 - kTableBits)], l = (e & kNoCode) ? 0 : len[(e >> 8) & 0xFF];
    put(i, e >> 8);
    bad |= e & kNoCode;
    win <<= l;
    have -= static_cast<int>(l);
  }
  const uint64_t used_bits = 32 * w - static_cast<uint64_t>(have);
  LS_CHECK(!bad, "lossless: corrupt buffer: block ", block, " holds a bit pattern that is no code");
  LS_CHECK(words_for(used_bits) == num_words && win == 0, "lossless: corrupt buffer: block ", block,
           " has ", num_words, " stream words but its ", n, " codes take ", used_bits,
           " bits (or its padding bits are not zero)");
}

// ---- header ----
void write_header(const Layout& L, const uint8_t len[256], uint8_t* dst) {
  uint8_t h[kHeaderBytes] = {};
  std::memcpy(h, kMagic, 4);
  store(h + 4, static_cast<uint16_t>(kVersion));
  h[6] = dtype_code(L.dtype);
  h[7] = *std::max_element(len, len + 256);
  store(h + 8, static_cast<uint64_t>(L.numel));
  store(h + 16, static_cast<uint32_t>(L.block_elems));
  store(h + 24, static_cast<uint64_t>(L.num_blocks));
  store(h + kHeaderStreamWordsAt, L.stream_words);
  store(h + 40, static_cast<uint64_t>(L.total_bytes()));
  for (int s = 0; s < 256; s += 2) h[kHeaderCodeLengthsAt + s / 2] = static_cast<uint8_t>(len[s] << 4 | len[s + 1]);
  std::memcpy(dst, h, kHeaderBytes);
}

bool all_zero(const uint8_t* p, size_t n) {
  return std::all_of(p, p + n, [](uint8_t b) { return b == 0; });
}

}  // namespace

size_t element_bytes(Dtype d) { return d == Dtype::F32 ? 4 : 2; }

void code_lengths(const uint64_t freq[256], uint8_t lengths[256]) {
  std::fill(lengths, lengths + 256, uint8_t{0});
  std::vector<int> syms;
  uint64_t total = 0;
  for (int s = 0; s < 256; ++s) {
    if (freq[s] == 0) continue;
    syms.push_back(s);
    LS_CHECK(freq[s] <= uint64_t{kMaxNumel} - total, "lossless: symbol frequencies over 2^56 in all");
    total += freq[s];
  }
  const size_t n = syms.size();
  if (n <= 1) {
    if (n == 1) lengths[syms[0]] = 1;  // one code, "0"
    return;
  }
  std::sort(syms.begin(), syms.end(), [&](int a, int b) { return freq[a] != freq[b] ? freq[a] < freq[b] : a < b; });
  // Package-merge (Larmore & Hirschberg 1990): level d holds the leaves and the
  // packages (pairs) of level d + 1's list, ascending by weight. The first
  // 2n - 2 items of level 1 are an optimal choice; each time a leaf is chosen
  // (directly, or inside a chosen package) its code gets one bit longer.
  struct Item {
    uint64_t weight;
    int leaf;  // index into syms, or -1 for a package
  };
  std::vector<Item> leaves(n);
  for (size_t i = 0; i < n; ++i) leaves[i] = {freq[syms[i]], static_cast<int>(i)};
  std::vector<std::vector<Item>> level(kMaxCodeLength);  // level[0]: depth 12, level[11]: depth 1
  level[0] = leaves;
  for (int d = 1; d < kMaxCodeLength; ++d) {
    const std::vector<Item>& deeper = level[static_cast<size_t>(d - 1)];
    std::vector<Item>& cur = level[static_cast<size_t>(d)];
    size_t li = 0, pi = 0;
    const size_t packages = deeper.size() / 2;
    while (li < n || pi < packages) {
      const uint64_t pw = pi < packages ? deeper[2 * pi].weight + deeper[2 * pi + 1].weight : 0;
      if (pi == packages || (li < n && leaves[li].weight <= pw)) {
        cur.push_back(leaves[li++]);
      } else {
        cur.push_back({pw, -1});
        ++pi;
      }
    }
  }
  size_t take = 2 * n - 2;
  for (int d = kMaxCodeLength - 1; d >= 0 && take > 0; --d) {
    const std::vector<Item>& cur = level[static_cast<size_t>(d)];
    LS_INTERNAL_CHECK(take <= cur.size());
    size_t packages = 0;
    for (size_t i = 0; i < take; ++i) {
      if (cur[i].leaf >= 0)
        ++lengths[syms[static_cast<size_t>(cur[i].leaf)]];
      else
        ++packages;
    }
    take = 2 * packages;
  }
}

Analysis analyze(Dtype dtype, const void* src, int64_t numel, int num_threads, int64_t block_elems) {
  Analysis A;
  A.layout = make_layout(dtype, numel, block_elems);
  LS_CHECK(numel == 0 || src != nullptr, "lossless: the source of ", numel, " elements is null");
  const Layout& L = A.layout;
  const int threads = resolve_threads(num_threads, numel);
  A.block_offsets.assign(static_cast<size_t>(L.num_blocks) + 1, 0);
  with_split(dtype, [&](auto split) {
    using S = decltype(split);
    // One pass over the source: each block's counts, then its size under the code.
    const auto sizes = [&](auto counts_type) {
      using C = decltype(counts_type);
      Histogram hist;
      const std::vector<C> counts = block_histograms<S, C>(src, L, threads, hist);
      code_lengths(hist.data(), A.code_lengths);
      for_ranges(L.num_blocks, block_tasks(threads), threads, [&](int64_t, int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const C* c = counts.data() + 256 * size_t(b);
          uint64_t bits = 0;
          for (int s = 0; s < 256; ++s) bits += uint32_t{c[s]} * A.code_lengths[s];
          A.block_offsets[static_cast<size_t>(b) + 1] = words_for(bits);  // shifted by one: see below
        }
      });
    };
    if (L.block_elems <= (int64_t{1} << 15))
      sizes(uint16_t{});
    else
      sizes(uint32_t{});
  });
  for (size_t b = 1; b < A.block_offsets.size(); ++b) A.block_offsets[b] += A.block_offsets[b - 1];
  A.layout.stream_words = A.block_offsets.back();
  return A;
}

void encode(const Analysis& A, const void* src, void* dst, size_t dst_bytes, int num_threads) {
  const Layout& L = A.layout;
  const Layout want = make_layout(L.dtype, L.numel, L.block_elems);
  LS_CHECK(L.num_blocks == want.num_blocks && A.block_offsets.size() == size_t(L.num_blocks) + 1 &&
               A.block_offsets[0] == 0 && A.block_offsets.back() == L.stream_words &&
               std::is_sorted(A.block_offsets.begin(), A.block_offsets.end()),
           "lossless: encode() needs the Analysis that analyze() returned");
  LS_CHECK(dst_bytes >= L.total_bytes(), "lossless: the destination holds ", dst_bytes,
           " bytes; the coded tensor needs ", L.total_bytes());
  LS_CHECK(L.numel == 0 || src != nullptr, "lossless: the source of ", L.numel, " elements is null");
  LS_CHECK(valid_lengths(A.code_lengths), "lossless: the Analysis holds invalid code lengths");
  const std::array<uint32_t, 256> enc = encode_table(A.code_lengths);
  auto* out = static_cast<uint8_t*>(dst);
  // Header, offsets, and every padding byte; the sections' contents come next.
  write_header(L, A.code_lengths, out);
  std::memcpy(out + L.offsets_offset(), A.block_offsets.data(), 8 * A.block_offsets.size());
  const size_t ends[4][2] = {{L.offsets_offset() + 8 * A.block_offsets.size(), L.raw_offset()},
                             {L.raw_offset() + size_t(L.numel), L.low16_offset()},
                             {L.low16_offset() + L.low16_bytes(), L.stream_offset()},
                             {L.stream_offset() + 4 * L.stream_words, L.total_bytes()}};
  for (const auto& gap : ends) std::memset(out + gap[0], 0, gap[1] - gap[0]);
  const int threads = resolve_threads(num_threads, L.numel);
  with_split(L.dtype, [&](auto split) {
    using S = decltype(split);
    for_ranges(L.num_blocks, block_tasks(threads), threads, [&](int64_t, int64_t b0, int64_t b1) {
      // A block's words are made here, then copied: a changed source cannot write past them.
      std::vector<uint32_t> scratch(words_for(12 * uint64_t(L.block_elems)) + 2);
      uint32_t* const words = scratch.data() + 1;  // encode_block writes words[-1] too
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t i0 = b * L.block_elems, n = std::min(L.numel, i0 + L.block_elems) - i0;
        const uint64_t w0 = A.block_offsets[size_t(b)], w1 = A.block_offsets[size_t(b) + 1];
        bool missing = false;
        const uint64_t made = encode_block<S>(
            static_cast<const uint8_t*>(src) + sizeof(typename S::T) * size_t(i0), n, enc.data(),
            out + L.raw_offset() + i0, L.low16_bytes() ? out + L.low16_offset() + 2 * i0 : nullptr,
            words, &missing);
        LS_CHECK(!missing && made == w1 - w0, "lossless: the source changed between analyze() and encode() (block ",
                 b, ")");
        std::memcpy(out + L.stream_offset() + 4 * w0, words, 4 * made);
      }
    });
  });
}

std::vector<uint8_t> encode(Dtype dtype, const void* src, int64_t numel, int num_threads,
                            int64_t block_elems) {
  const Analysis A = analyze(dtype, src, numel, num_threads, block_elems);
  std::vector<uint8_t> out(A.total_bytes());
  encode(A, src, out.data(), out.size(), num_threads);
  return out;
}

Header read_header(const void* encoded, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(encoded);
  LS_CHECK(p != nullptr || bytes == 0, "lossless: the coded buffer is null");
  LS_CHECK(bytes >= kHeaderBytes, "lossless: truncated buffer: ", bytes,
           " bytes, the header alone is ", kHeaderBytes);
  LS_CHECK(std::memcmp(p, kMagic, 4) == 0, "lossless: not a coded tensor (the magic is not \"LSLL\")");
  const uint16_t version = load<uint16_t>(p + 4);
  LS_CHECK(version == kVersion, "lossless: format version ", version, " is not supported (this build reads ",
           kVersion, ")");
  Header H;
  Layout& L = H.layout;
  switch (p[6]) {
    case 1: L.dtype = Dtype::BF16; break;
    case 2: L.dtype = Dtype::F16; break;
    case 3: L.dtype = Dtype::F32; break;
    default: LS_FAIL("lossless: corrupt header: dtype code ", int(p[6]), " (1 bf16, 2 f16, 3 f32)");
  }
  H.max_code_length = p[7];
  const uint64_t numel = load<uint64_t>(p + 8);
  LS_CHECK(numel <= uint64_t{kMaxNumel}, "lossless: corrupt header: numel ", numel);
  L.numel = static_cast<int64_t>(numel);
  L.block_elems = load<uint32_t>(p + 16);
  check_block_elems(L.block_elems);
  const int64_t num_blocks = (L.numel + L.block_elems - 1) / L.block_elems;
  LS_CHECK(load<uint64_t>(p + 24) == uint64_t(num_blocks), "lossless: corrupt header: ",
           load<uint64_t>(p + 24), " blocks, but ", L.numel, " elements in blocks of ",
           L.block_elems, " make ", num_blocks);
  L.num_blocks = num_blocks;
  L.stream_words = load<uint64_t>(p + kHeaderStreamWordsAt);
  // Each code has at most 12 bits; each block pads to a word.
  LS_CHECK(L.stream_words <= (numel * kMaxCodeLength + 31) / 32 + uint64_t(num_blocks),
           "lossless: corrupt header: ", L.stream_words, " stream words for ", numel, " elements");
  LS_CHECK(all_zero(p + 20, 4) && all_zero(p + 48, 16) && all_zero(p + 192, kHeaderBytes - 192),
           "lossless: corrupt header: reserved bytes are not zero");
  int max_len = 0, used = 0;
  for (int s = 0; s < 256; ++s) {
    H.code_lengths[s] = device::code_length_at(p, s);
    max_len = std::max<int>(max_len, H.code_lengths[s]);
    used += H.code_lengths[s] != 0;
  }
  LS_CHECK(max_len == H.max_code_length && (numel == 0) == (used == 0) && valid_lengths(H.code_lengths),
           "lossless: corrupt header: the code lengths (", used, " symbols, longest ", max_len,
           ", recorded ", H.max_code_length, ") are not a complete prefix code of at most ",
           kMaxCodeLength, " bits");
  const uint64_t total = load<uint64_t>(p + 40);
  LS_CHECK(total == L.total_bytes(), "lossless: corrupt header: total size ", total, " bytes, the sections make ",
           L.total_bytes());
  LS_CHECK(bytes >= total, "lossless: truncated buffer: ", bytes, " bytes of a coded tensor of ", total);
  // Offsets: from 0, ascending, to stream_words; no block longer than 12 bits a code.
  const uint8_t* offs = p + L.offsets_offset();
  LS_CHECK(load<uint64_t>(offs) == 0 && load<uint64_t>(offs + 8 * size_t(num_blocks)) == L.stream_words,
           "lossless: corrupt block offsets: they must run from 0 to the ", L.stream_words, " stream words");
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint64_t w0 = load<uint64_t>(offs + 8 * size_t(b)), w1 = load<uint64_t>(offs + 8 * size_t(b) + 8);
    const int64_t n = std::min(L.numel, (b + 1) * L.block_elems) - b * L.block_elems;
    LS_CHECK(w0 <= w1 && w1 - w0 <= words_for(uint64_t(n) * uint64_t(max_len)),
             "lossless: corrupt block offsets: block ", b, " spans words ", w0, " to ", w1);
  }
  return H;
}

void decode(const void* encoded, size_t bytes, void* dst, size_t dst_bytes, int num_threads) {
  const Header H = read_header(encoded, bytes);
  const Layout& L = H.layout;
  LS_CHECK(dst_bytes >= size_t(L.numel) * element_bytes(L.dtype), "lossless: the destination holds ",
           dst_bytes, " bytes; ", L.numel, " ", quant::to_string(L.dtype), " elements need ",
           size_t(L.numel) * element_bytes(L.dtype));
  LS_CHECK(L.numel == 0 || dst != nullptr, "lossless: the destination is null");
  const std::vector<uint32_t> table = decode_table(H.code_lengths);
  const auto* p = static_cast<const uint8_t*>(encoded);
  auto* out = static_cast<uint8_t*>(dst);
  const int threads = resolve_threads(num_threads, L.numel);
  with_split(L.dtype, [&](auto split) {
    using S = decltype(split);
    for_ranges(L.num_blocks, block_tasks(threads), threads, [&](int64_t, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t i0 = b * L.block_elems, n = std::min(L.numel, i0 + L.block_elems) - i0;
        const uint64_t w0 = load<uint64_t>(p + L.offsets_offset() + 8 * size_t(b));
        const uint64_t w1 = load<uint64_t>(p + L.offsets_offset() + 8 * size_t(b) + 8);
        decode_block<S>(p + L.stream_offset() + 4 * w0, w1 - w0, table.data(), H.code_lengths,
                        p + L.raw_offset() + i0,
                        L.low16_bytes() ? p + L.low16_offset() + 2 * i0 : nullptr,
                        out + sizeof(typename S::T) * size_t(i0), n, b);
      }
    });
  });
}

size_t max_encoded_bytes(Dtype dtype, int64_t numel, int64_t block_elems) {
  // The optimal code costs at most 8 bits a symbol (a fixed 8-bit code is one
  // of the candidates); each block pads to at most one more word.
  Layout L = make_layout(dtype, numel, block_elems);
  L.stream_words = uint64_t(numel) / 4 + uint64_t(L.num_blocks);
  return L.total_bytes();
}

size_t estimate_encoded_bytes(Dtype dtype, const void* sample, int64_t sample_numel, int64_t numel,
                              int64_t block_elems) {
  Layout L = make_layout(dtype, numel, block_elems);
  LS_CHECK(sample_numel >= 1 && sample_numel <= kMaxNumel && sample != nullptr,
           "lossless: an estimate needs a sample of at least one element, got ", sample_numel);
  uint64_t freq[256] = {};
  with_split(dtype, [&](auto split) {
    using S = decltype(split);
    for (int64_t i = 0; i < sample_numel; ++i) ++freq[S::sym(elem<S>(sample, i))];
  });
  uint8_t len[256];
  code_lengths(freq, len);
  double bits_per_elem = 0;
  for (int s = 0; s < 256; ++s) bits_per_elem += double(freq[s]) * len[s];
  bits_per_elem /= double(sample_numel);
  L.stream_words = uint64_t(bits_per_elem * double(numel) / 32.0) + 1 + uint64_t(L.num_blocks);
  return L.total_bytes();
}

int64_t expert_pieces(Dtype dtype, int64_t numel, int64_t dim0, int64_t experts) {
  if (experts <= 1 || dim0 != experts || numel <= 0 || numel % experts != 0) return 1;
  const uint64_t piece_out = static_cast<uint64_t>(numel / experts) * element_bytes(dtype);
  return piece_out % 16 == 0 ? experts : 1;
}

PiecesAnalysis analyze_pieces(Dtype dtype, const void* src, int64_t numel, int64_t count, int num_threads) {
  LS_CHECK(count >= 1 && numel >= 0 && numel % count == 0, "lossless: ", numel, " elements cannot be cut into ",
           count, " equal pieces");
  const int64_t n = numel / count;
  const size_t esz = element_bytes(dtype);
  PiecesAnalysis P;
  P.pieces.reserve(static_cast<size_t>(count));
  P.offsets.reserve(static_cast<size_t>(count) + 1);
  P.offsets.push_back(0);
  for (int64_t k = 0; k < count; ++k) {
    P.pieces.push_back(analyze(dtype, static_cast<const char*>(src) + static_cast<size_t>(k * n) * esz, n,
                               num_threads));
    P.offsets.push_back(P.offsets.back() + P.pieces.back().total_bytes());
  }
  return P;
}

size_t max_pieces_bytes(Dtype dtype, int64_t numel, int64_t count) {
  LS_CHECK(count >= 1 && numel >= 0 && numel % count == 0, "lossless: ", numel, " elements cannot be cut into ",
           count, " equal pieces");
  return static_cast<size_t>(count) * max_encoded_bytes(dtype, numel / count);
}

void encode_pieces(const PiecesAnalysis& P, const void* src, void* dst, size_t dst_bytes, int num_threads) {
  LS_CHECK(dst_bytes >= P.total_bytes(), "lossless: ", P.total_bytes(), " coded bytes do not fit in ", dst_bytes);
  for (size_t k = 0; k < P.pieces.size(); ++k) {
    const Analysis& A = P.pieces[k];
    const size_t in = static_cast<size_t>(A.layout.numel) * element_bytes(A.layout.dtype);
    encode(A, static_cast<const char*>(src) + k * in, static_cast<char*>(dst) + P.offsets[k], A.total_bytes(),
           num_threads);
  }
}

uint64_t sample_fingerprint(const void* data, size_t bytes, size_t samples) {
  const auto* p = static_cast<const uint8_t*>(data);
  const size_t words = bytes / 8;
  uint64_t h = 0x9E3779B97F4A7C15ull ^ bytes;
  const auto mix = [&h](uint64_t v) {  // splitmix64 of the running hash and the word
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
  };
  if (words > 0) {
    const size_t n = samples == 0 ? 1 : std::min(samples, words);
    for (size_t k = 0; k < n; ++k) {
      const size_t w = n == words ? k : static_cast<size_t>((static_cast<unsigned __int128>(k) * (words - 1)) / (n - 1 ? n - 1 : 1));
      mix(load<uint64_t>(p + 8 * w) ^ w);
    }
  }
  uint64_t tail = 0;
  if (bytes % 8) std::memcpy(&tail, p + 8 * words, bytes % 8);
  mix(tail);
  return h;
}

}  // namespace lossless
}  // namespace layerstream
