// GGUF block formats (quant.h, gguf_blocks.h) and the .gguf reader (gguf.h).
// The bit-for-bit comparison with gguf-py's numpy dequantization of random
// blocks lives in tests/python/test_gguf.py; here: hand-built blocks with
// known values, layouts, row ranges, refusals, and the reader on files built
// byte by byte.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/gguf.h"
#include "core/gguf_blocks.h"
#include "core/quant.h"

using namespace layerstream;
using quant::Format;

namespace {

void put_half(uint8_t* p, float v) {
  const uint16_t h = quant::float_to_f16_bits(v);
  p[0] = static_cast<uint8_t>(h & 0xFF);
  p[1] = static_cast<uint8_t>(h >> 8);
}

std::vector<float> dequant(Format f, int64_t rows, int64_t cols, const std::vector<uint8_t>& blocks) {
  const quant::PackedLayout L = quant::layout_for(f, rows, cols);
  EXPECT_EQ(L.data_bytes, blocks.size());
  std::vector<float> out(static_cast<size_t>(rows * cols));
  quant::dequantize_cpu(L, blocks.data(), out.data(), quant::OutDtype::F32, 1);
  return out;
}

}  // namespace

TEST(GgufFormats, NamesLayoutsAndRefusals) {
  const struct { Format f; const char* name; int64_t elems; size_t bytes; } rows[] = {
      {Format::GgufQ8_0, "q8_0", 32, 34},   {Format::GgufQ4_0, "q4_0", 32, 18},
      {Format::GgufQ4_1, "q4_1", 32, 20},   {Format::GgufQ5_0, "q5_0", 32, 22},
      {Format::GgufQ5_1, "q5_1", 32, 24},   {Format::GgufQ2_K, "q2_k", 256, 84},
      {Format::GgufQ3_K, "q3_k", 256, 110}, {Format::GgufQ4_K, "q4_k", 256, 144},
      {Format::GgufQ5_K, "q5_k", 256, 176}, {Format::GgufQ6_K, "q6_k", 256, 210},
  };
  for (const auto& r : rows) {
    SCOPED_TRACE(r.name);
    EXPECT_TRUE(quant::is_gguf(r.f));
    EXPECT_STREQ(quant::to_string(r.f), r.name);
    EXPECT_EQ(quant::parse_packed_format(r.name), r.f);
    EXPECT_EQ(quant::parse_packed_format(std::string(r.name) == "q4_k" ? "Q4_K" : r.name), r.f);
    const quant::PackedLayout L = quant::layout_for(r.f, 3, 2 * r.elems);
    EXPECT_EQ(L.block_size, r.elems);
    EXPECT_EQ(L.data_bytes, 3 * 2 * r.bytes);
    EXPECT_EQ(L.scale_bytes, 0u);
    EXPECT_EQ(L.zero_bytes, 0u);
    EXPECT_EQ(L.total_bytes() % 256, 0u);
    // Row ranges are whole rows of blocks, anywhere.
    const quant::RowRange rr = quant::row_range(L, 1, 3);
    EXPECT_EQ(rr.data_begin, 2 * r.bytes);
    EXPECT_EQ(rr.data_bytes, 2 * 2 * r.bytes);
    // Not whole blocks; not produced by pack(); not a quantize= name; no error bound.
    try {
      quant::layout_for(r.f, 2, r.elems + 16);
      ADD_FAILURE() << "accepted a partial block";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("must be a multiple of " + std::to_string(r.elems)), std::string::npos)
          << e.message();
    }
    std::vector<float> src(static_cast<size_t>(2 * r.elems), 1.0f);
    std::vector<uint8_t> dst(L.total_bytes());
    try {
      quant::pack(r.f, src.data(), 1, 2 * r.elems, dst.data());
      ADD_FAILURE() << "pack produced a GGUF format";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("does not quantize to GGUF's"), std::string::npos) << e.message();
    }
    try {
      quant::parse_format(r.name);
      ADD_FAILURE() << "parse_format accepted a GGUF name";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("is a GGUF format"), std::string::npos) << e.message();
    }
    EXPECT_THROW(quant::error_bound(L, dst.data(), 0, 0, 1.0f), Error);
  }
  // Where each format's fp16 scale fields are (ggml's block_q* structs).
  const struct { int fmt, n, a, b; } halves[] = {
      {quant::gguf::kQ8_0, 1, 0, -1}, {quant::gguf::kQ4_0, 1, 0, -1}, {quant::gguf::kQ4_1, 2, 0, 2},
      {quant::gguf::kQ5_0, 1, 0, -1}, {quant::gguf::kQ5_1, 2, 0, 2},  {quant::gguf::kQ2_K, 2, 80, 82},
      {quant::gguf::kQ3_K, 1, 108, -1}, {quant::gguf::kQ4_K, 2, 0, 2}, {quant::gguf::kQ5_K, 2, 0, 2},
      {quant::gguf::kQ6_K, 1, 208, -1}};
  for (const auto& h : halves) {
    int off[2];
    ASSERT_EQ(quant::gguf::half_fields(h.fmt, off), h.n) << h.fmt;
    EXPECT_EQ(off[0], h.a) << h.fmt;
    if (h.n == 2) {
      EXPECT_EQ(off[1], h.b) << h.fmt;
    }
  }
  EXPECT_FALSE(quant::is_gguf(Format::NF4));
  EXPECT_FALSE(quant::is_gguf(Format::None));
}

TEST(GgufFormats, Q8_0AndQ4_0KnownValues) {
  // q8_0: d = 0.5, codes -128..127 -> code * 0.5.
  std::vector<uint8_t> b(34);
  put_half(b.data(), 0.5f);
  for (int e = 0; e < 32; ++e) b[2 + e] = static_cast<uint8_t>(static_cast<int8_t>(e * 8 - 128));
  std::vector<float> v = dequant(Format::GgufQ8_0, 1, 32, b);
  for (int e = 0; e < 32; ++e) EXPECT_EQ(v[e], (e * 8 - 128) * 0.5f) << e;
  // q4_0: d = -2, element e < 16 in the low nibble of byte e, e >= 16 in the
  // high nibble of byte e - 16; value d * (q - 8).
  std::vector<uint8_t> c(18);
  put_half(c.data(), -2.0f);
  for (int k = 0; k < 16; ++k) c[2 + k] = static_cast<uint8_t>((15 - k) << 4 | k);
  v = dequant(Format::GgufQ4_0, 1, 32, c);
  for (int e = 0; e < 16; ++e) EXPECT_EQ(v[e], -2.0f * (e - 8)) << e;
  for (int e = 16; e < 32; ++e) EXPECT_EQ(v[e], -2.0f * ((15 - (e - 16)) - 8)) << e;
}

TEST(GgufFormats, Q4_1AndQ5_0KnownValues) {
  // q4_1: d = 0.25, m = -1, q = e % 16 -> 0.25 * q - 1.
  std::vector<uint8_t> b(20);
  put_half(b.data(), 0.25f);
  put_half(b.data() + 2, -1.0f);
  for (int k = 0; k < 16; ++k) b[4 + k] = static_cast<uint8_t>(k << 4 | k);
  std::vector<float> v = dequant(Format::GgufQ4_1, 1, 32, b);
  for (int e = 0; e < 32; ++e) EXPECT_EQ(v[e], 0.25f * (e % 16) - 1.0f) << e;
  // q5_0: the fifth bit of element e is bit e of the uint32 after d.
  std::vector<uint8_t> c(22, 0);
  put_half(c.data(), 1.0f);
  const uint32_t qh = 0xA5A5F00Fu;
  std::memcpy(c.data() + 2, &qh, 4);  // little-endian hosts (every one we build for)
  for (int k = 0; k < 16; ++k) c[6 + k] = 0x73;  // low nibble 3, high nibble 7
  v = dequant(Format::GgufQ5_0, 1, 32, c);
  for (int e = 0; e < 32; ++e) {
    const int q = (e < 16 ? 3 : 7) | (((qh >> e) & 1) << 4);
    EXPECT_EQ(v[e], static_cast<float>(q - 16)) << e;
  }
}

TEST(GgufFormats, Q6_KKnownValuesAndScaleGroups) {
  // q6_k: ql[128] | qh[64] | scales[16] int8 | d. All ql bytes 0x21 (low
  // nibble 1, high 2), qh 0 -> q = 1 or 2, minus 32; scale of group g = g - 8.
  std::vector<uint8_t> b(210, 0);
  for (int k = 0; k < 128; ++k) b[k] = 0x21;
  for (int g = 0; g < 16; ++g) b[192 + g] = static_cast<uint8_t>(static_cast<int8_t>(g - 8));
  put_half(b.data() + 208, 0.5f);
  std::vector<float> v = dequant(Format::GgufQ6_K, 1, 256, b);
  for (int e = 0; e < 256; ++e) {
    const int r = e % 128;
    const int q = (r < 64 ? 1 : 2) - 32;  // the first 64 of each half use the low nibble
    EXPECT_EQ(v[e], 0.5f * (e / 16 - 8) * q) << e;
  }
}

TEST(GgufFormats, RowsAloneMatchTheWholeTensor) {
  std::vector<uint8_t> blocks(5 * 2 * 144);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<uint8_t>(i * 37 + 11);
  for (size_t b = 0; b < 10; ++b) {  // finite d and dmin
    put_half(&blocks[b * 144], 0.01f * static_cast<float>(b + 1));
    put_half(&blocks[b * 144 + 2], -0.02f * static_cast<float>(b));
  }
  const quant::PackedLayout L = quant::layout_for(Format::GgufQ4_K, 5, 512);
  std::vector<float> whole(5 * 512), part(2 * 512);
  quant::dequantize_cpu(L, blocks.data(), whole.data(), quant::OutDtype::F32, 1);
  quant::dequantize_rows_cpu(L, blocks.data(), 3, 5, part.data(), quant::OutDtype::F32, 1);
  EXPECT_EQ(0, std::memcmp(part.data(), whole.data() + 3 * 512, part.size() * sizeof(float)));
  for (float x : whole) EXPECT_TRUE(std::isfinite(x));
}

// ---- the reader ----

namespace {

struct Writer {
  std::string b;
  void u32(uint32_t v) { for (int i = 0; i < 4; ++i) b += static_cast<char>((v >> (8 * i)) & 0xFF); }
  void u64(uint64_t v) { for (int i = 0; i < 8; ++i) b += static_cast<char>((v >> (8 * i)) & 0xFF); }
  void str(const std::string& s) { u64(s.size()); b += s; }
  void pad(size_t align) { while (b.size() % align) b += '\0'; }
};

// Two tensors: "w" [2, 64] Q4_0 at data offset 0, "b" [3] F32 at 96.
std::string small_file(uint32_t version = 3) {
  Writer w;
  w.b = "GGUF";
  w.u32(version);
  w.u64(2);  // tensors
  w.u64(3);  // metadata
  w.str("general.name"); w.u32(8); w.str("tiny");
  w.str("x.list"); w.u32(9); w.u32(5); w.u64(3); w.u32(1); w.u32(2); w.u32(3);
  w.str("x.flag"); w.u32(7); w.b += '\1';
  w.str("w"); w.u32(2); w.u64(64); w.u64(2); w.u32(2); w.u64(0);
  w.str("b"); w.u32(1); w.u64(3); w.u32(0); w.u64(96);
  w.pad(32);
  w.b += std::string(72, 'q');  // w: 2 rows x 2 blocks x 18 bytes
  w.pad(32);
  w.b += std::string(12, 'f');
  return w.b;
}

}  // namespace

TEST(GgufReader, ReadsHeaderMetadataAndTensors) {
  const std::string f = small_file();
  const GgufFile g = parse_gguf(f, f.size(), "mem.gguf");
  EXPECT_EQ(g.version, 3u);
  EXPECT_EQ(g.alignment, 32u);
  EXPECT_EQ(g.data_offset % 32, 0u);
  EXPECT_EQ(g.metadata.at("general.name"), "tiny");
  EXPECT_EQ(g.metadata.at("x.list"), "[1, 2, 3]");
  EXPECT_EQ(g.metadata.at("x.flag"), "true");
  ASSERT_EQ(g.tensors.size(), 2u);
  EXPECT_EQ(g.tensors[0].name, "w");
  EXPECT_EQ(g.tensors[0].shape, (std::vector<uint64_t>{2, 64}));  // dims reversed
  EXPECT_EQ(g.tensors[0].type_name, "Q4_0");
  EXPECT_EQ(g.tensors[0].nbytes, 72u);
  EXPECT_EQ(g.tensors[0].offset, g.data_offset);
  EXPECT_EQ(f.substr(g.tensors[0].offset, 72), std::string(72, 'q'));
  EXPECT_EQ(g.tensors[1].offset, g.data_offset + 96);
  EXPECT_EQ(f.substr(g.tensors[1].offset, 12), std::string(12, 'f'));
  EXPECT_EQ(ggml_type_format(2), Format::GgufQ4_0);
  EXPECT_EQ(ggml_type_format(0), Format::None);
  EXPECT_EQ(ggml_type_format(20), Format::None);  // IQ4_NL: known, not dequantized
  EXPECT_STREQ(ggml_type(20).name, "IQ4_NL");
  EXPECT_EQ(ggml_type(99).name, nullptr);

  // The same from a file, header read in growing pieces.
  const std::string path = ::testing::TempDir() + "/ls_test_small.gguf";
  { std::ofstream(path, std::ios::binary) << f; }
  const GgufFile h = read_gguf(path);
  EXPECT_EQ(h.tensors[1].offset, g.tensors[1].offset);
  std::remove(path.c_str());
}

// A damaged header: a tensor named twice, or a name that is not UTF-8, is an
// error saying the file is damaged (it was blamed on rename=, or reached
// Python as a bare UnicodeDecodeError).
TEST(GgufReader, DuplicateOrNonUtf8NamesAreADamagedFile) {
  for (const std::string& second : {std::string("w"), std::string("b\xff")}) {
    Writer w;
    w.b = "GGUF";
    w.u32(3);
    w.u64(2);
    w.u64(0);
    w.str("w"); w.u32(1); w.u64(3); w.u32(0); w.u64(0);
    w.str(second); w.u32(1); w.u64(3); w.u32(0); w.u64(32);
    w.pad(32);
    w.b += std::string(64, 'f');
    std::string msg;
    try {
      parse_gguf(w.b, w.b.size(), "mem.gguf");
    } catch (const Error& e) {
      msg = e.message();
    }
    EXPECT_NE(msg.find(second == "w" ? "tensor 'w' is named twice" : "a tensor name at byte"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("the file is damaged"), std::string::npos) << msg;
  }
}

TEST(GgufReader, HeadersLargerThanTheFirstReadAreReadWhole) {
  // A 3 MiB metadata string (vocabularies make real headers megabytes long):
  // read_gguf reads the first MiB, then more until the header is whole.
  Writer w;
  w.b = "GGUF";
  w.u32(3);
  w.u64(1);
  w.u64(1);
  w.str("tokenizer.big");
  w.u32(8);
  w.str(std::string(3u << 20, 't'));
  w.str("w"); w.u32(1); w.u64(32); w.u32(8); w.u64(0);  // Q8_0 [32]
  w.pad(32);
  w.b += std::string(34, 'z');
  const std::string path = ::testing::TempDir() + "/ls_test_big_header.gguf";
  { std::ofstream(path, std::ios::binary) << w.b; }
  const GgufFile g = read_gguf(path);
  std::remove(path.c_str());
  EXPECT_EQ(g.metadata.at("tokenizer.big").size(), 3u << 20);
  ASSERT_EQ(g.tensors.size(), 1u);
  EXPECT_EQ(g.tensors[0].offset + 34, w.b.size());
}

TEST(GgufReader, DamagedFilesAreOneClearError) {
  const std::string f = small_file();
  auto message = [](const std::string& bytes, uint64_t size) {
    try {
      parse_gguf(bytes, size, "bad.gguf");
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_NE(message("GGML" + f.substr(4), f.size()).find("is not a GGUF file"), std::string::npos);
  EXPECT_NE(message(small_file(1), f.size()).find("GGUF version 1 is not supported"), std::string::npos);
  EXPECT_NE(message(f.substr(0, 50), 50).find("the file ends (50 bytes) while reading"), std::string::npos);
  EXPECT_NE(message(f.substr(0, f.size() - 1), f.size() - 1).find("tensor 'b' (12 bytes at data offset 96) "
                                                                   "runs past the end"),
            std::string::npos);
  std::string huge = f;  // general.name's length field claims more than the file
  huge[24 + 8 + 12 + 4 + 7] = '\x7F';  // the top byte of its uint64
  EXPECT_NE(message(huge, huge.size()).find("more than the file holds"), std::string::npos);
  EXPECT_NE(message("", 0).find("is not a GGUF file"), std::string::npos);
  {  // an F32 tensor of 2^62 elements: 2^64 bytes wrapped to 0, which passed the end-of-file check
    Writer w;
    w.b = "GGUF";
    w.u32(3);
    w.u64(1);
    w.u64(0);
    w.str("b"); w.u32(1); w.u64(uint64_t{1} << 62); w.u32(0); w.u64(0);
    w.pad(32);
    EXPECT_NE(message(w.b, w.b.size()).find("tensor 'b' (F32) has 4611686018427387904 elements: more bytes than fit "
                                            "in 64 bits; the file is damaged"),
              std::string::npos)
        << message(w.b, w.b.size());
  }
  try {
    read_gguf(::testing::TempDir() + "/ls_no_such.gguf");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("does not exist"), std::string::npos);
  }
}

TEST(GgufReader, DamagedBytesOnlyEverThrowLayerstreamError) {
  // Bit flips, byte overwrites and truncations of a valid file: the parser
  // either reads it or throws layerstream::Error, never anything else (no
  // crash, no std:: exception, no runaway allocation).
  const std::string good = small_file();
  std::mt19937 rng(12345);
  int parsed = 0, refused = 0;
  for (int it = 0; it < 20000; ++it) {
    std::string f = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % f.size();
      switch (rng() % 3) {
        case 0: f[at] = static_cast<char>(f[at] ^ (1 << (rng() % 8))); break;
        case 1: f[at] = static_cast<char>(rng() & 0xFF); break;
        default: f.resize(at); break;
      }
      if (f.empty()) break;
    }
    try {
      parse_gguf(f, f.size(), "fuzz.gguf");
      ++parsed;
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(parsed, 0);
}
