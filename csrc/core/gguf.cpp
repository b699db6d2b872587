// layerstream — GGUF file reader. See gguf.h.
#include "gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <system_error>

#include "error.h"
#include "json.h"

namespace layerstream {

namespace {

namespace fs = std::filesystem;

struct TypeRow {
  uint32_t id;
  GgmlType t;
  quant::Format format;
};

// Sizes as in ggml (ggml.c's type traits; gguf-py's GGML_QUANT_SIZES).
const TypeRow kTypes[] = {
    {0, {"F32", 1, 4}, quant::Format::None},
    {1, {"F16", 1, 2}, quant::Format::None},
    {2, {"Q4_0", 32, 18}, quant::Format::GgufQ4_0},
    {3, {"Q4_1", 32, 20}, quant::Format::GgufQ4_1},
    {6, {"Q5_0", 32, 22}, quant::Format::GgufQ5_0},
    {7, {"Q5_1", 32, 24}, quant::Format::GgufQ5_1},
    {8, {"Q8_0", 32, 34}, quant::Format::GgufQ8_0},
    {9, {"Q8_1", 32, 40}, quant::Format::None},
    {10, {"Q2_K", 256, 84}, quant::Format::GgufQ2_K},
    {11, {"Q3_K", 256, 110}, quant::Format::GgufQ3_K},
    {12, {"Q4_K", 256, 144}, quant::Format::GgufQ4_K},
    {13, {"Q5_K", 256, 176}, quant::Format::GgufQ5_K},
    {14, {"Q6_K", 256, 210}, quant::Format::GgufQ6_K},
    {15, {"Q8_K", 256, 292}, quant::Format::None},
    {16, {"IQ2_XXS", 256, 66}, quant::Format::None},
    {17, {"IQ2_XS", 256, 74}, quant::Format::None},
    {18, {"IQ3_XXS", 256, 98}, quant::Format::None},
    {19, {"IQ1_S", 256, 50}, quant::Format::None},
    {20, {"IQ4_NL", 32, 18}, quant::Format::None},
    {21, {"IQ3_S", 256, 110}, quant::Format::None},
    {22, {"IQ2_S", 256, 82}, quant::Format::None},
    {23, {"IQ4_XS", 256, 136}, quant::Format::None},
    {24, {"I8", 1, 1}, quant::Format::None},
    {25, {"I16", 1, 2}, quant::Format::None},
    {26, {"I32", 1, 4}, quant::Format::None},
    {27, {"I64", 1, 8}, quant::Format::None},
    {28, {"F64", 1, 8}, quant::Format::None},
    {29, {"IQ1_M", 256, 56}, quant::Format::None},
    {30, {"BF16", 1, 2}, quant::Format::None},
    {34, {"TQ1_0", 256, 54}, quant::Format::None},
    {35, {"TQ2_0", 256, 66}, quant::Format::None},
    {39, {"MXFP4", 32, 17}, quant::Format::None},
    {40, {"NVFP4", 64, 36}, quant::Format::None},
    {41, {"Q1_0", 128, 18}, quant::Format::None},
};

const TypeRow* find_type(uint32_t id) {
  for (const auto& r : kTypes)
    if (r.id == id) return &r;
  return nullptr;
}

// Thrown by Cursor when the image ends before the header does and the file
// is longer than the image: read_gguf then reads more.
struct NeedMore {};

enum ValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

const char* value_type_name(uint32_t t) {
  static const char* names[] = {"UINT8", "INT8",  "UINT16", "INT16",  "UINT32", "INT32", "FLOAT32",
                                "BOOL",  "STRING", "ARRAY", "UINT64", "INT64",  "FLOAT64"};
  return t < 13 ? names[t] : "?";
}

size_t scalar_bytes(uint32_t t) {
  switch (t) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32: return 4;
    case kU64: case kI64: case kF64: return 8;
    default: return 0;
  }
}

class Cursor {
 public:
  Cursor(std::string_view bytes, uint64_t file_bytes, const std::string& what)
      : b_(bytes), file_bytes_(file_bytes), what_(what) {}

  uint64_t pos() const { return pos_; }

  // n more bytes, or an error naming what was being read.
  const char* take(uint64_t n, const char* reading) {
    if (n > b_.size() - std::min<uint64_t>(pos_, b_.size())) {
      if (n <= file_bytes_ && pos_ + n <= file_bytes_ && b_.size() < file_bytes_) throw NeedMore{};
      LS_FAIL(what_, ": the file ends (", file_bytes_, " bytes) while reading ", reading, " at byte ", pos_,
              "; the file is truncated or not GGUF");
    }
    const char* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  template <class T>
  T get(const char* reading) {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(take(sizeof(T), reading));
    uint64_t v = 0;
    for (size_t i = sizeof(T); i-- > 0;) v = (v << 8) | p[i];
    T out;
    if constexpr (sizeof(T) == 8) {
      std::memcpy(&out, &v, 8);
    } else {
      using U = std::conditional_t<sizeof(T) == 4, uint32_t, std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>;
      const U u = static_cast<U>(v);
      std::memcpy(&out, &u, sizeof(T));
    }
    return out;
  }
  std::string string(const char* reading) {
    const uint64_t n = get<uint64_t>(reading);
    if (n > file_bytes_)
      LS_FAIL(what_, ": ", reading, " at byte ", pos_ - 8, " claims ", n, " bytes, more than the file holds; "
              "the file is damaged or not GGUF");
    const uint64_t at = pos_;
    const char* p = take(n, reading);
    std::string s(p, static_cast<size_t>(n));
    // GGUF strings are UTF-8: one that is not cannot be named back to the user.
    if (!json::valid_utf8(s))
      LS_FAIL(what_, ": ", reading, " at byte ", at, " is not valid UTF-8; the file is damaged");
    return s;
  }

 private:
  std::string_view b_;
  uint64_t file_bytes_;
  const std::string& what_;
  uint64_t pos_ = 0;
};

std::string scalar_text(Cursor& c, uint32_t t, const char* reading) {
  switch (t) {
    case kU8: return std::to_string(c.get<uint8_t>(reading));
    case kI8: return std::to_string(c.get<int8_t>(reading));
    case kU16: return std::to_string(c.get<uint16_t>(reading));
    case kI16: return std::to_string(c.get<int16_t>(reading));
    case kU32: return std::to_string(c.get<uint32_t>(reading));
    case kI32: return std::to_string(c.get<int32_t>(reading));
    case kF32: return detail::compose(c.get<float>(reading));
    case kBool: return c.get<uint8_t>(reading) ? "true" : "false";
    case kU64: return std::to_string(c.get<uint64_t>(reading));
    case kI64: return std::to_string(c.get<int64_t>(reading));
    case kF64: return detail::compose(c.get<double>(reading));
    case kString: return c.string(reading);
    default: return "";
  }
}

std::string value_text(Cursor& c, uint32_t t, const std::string& what, const std::string& key,
                       uint64_t file_bytes) {
  const std::string reading = "the value of key '" + key + "'";
  if (t == kArray) {
    const uint32_t et = c.get<uint32_t>(reading.c_str());
    const uint64_t n = c.get<uint64_t>(reading.c_str());
    LS_CHECK(et <= kF64 && et != kArray, what, ": key '", key, "' is an array of unknown value type ", et,
             "; the file is damaged or newer than this reader");
    if (et == kString) {
      LS_CHECK(n <= file_bytes / 8, what, ": key '", key, "' claims ", n, " strings, more than the file holds");
      for (uint64_t i = 0; i < n; ++i) c.string(reading.c_str());
      return detail::compose("[", n, " x STRING]");
    }
    const size_t w = scalar_bytes(et);
    if (n <= 16) {
      std::string s = "[";
      for (uint64_t i = 0; i < n; ++i) s += (i ? ", " : "") + scalar_text(c, et, reading.c_str());
      return s + "]";
    }
    LS_CHECK(n <= std::numeric_limits<uint64_t>::max() / w, what, ": key '", key, "' claims ", n, " elements");
    c.take(n * w, reading.c_str());
    return detail::compose("[", n, " x ", value_type_name(et), "]");
  }
  LS_CHECK(t <= kF64, what, ": key '", key, "' has unknown value type ", t,
           "; the file is damaged or newer than this reader");
  return scalar_text(c, t, reading.c_str());
}

}  // namespace

GgmlType ggml_type(uint32_t id) {
  const TypeRow* r = find_type(id);
  return r ? r->t : GgmlType{};
}

bool ggml_type_by_name(std::string_view name, uint32_t& id) {
  for (const auto& r : kTypes)
    if (name == r.t.name) {
      id = r.id;
      return true;
    }
  return false;
}

std::string gguf_type_unreadable(const std::string& path, const std::string& tensor, const std::string& type_name) {
  return path + ": tensor '" + tensor + "' is GGUF type " + type_name + ", which layerstream cannot read; "
         "supported: F32, F16, BF16, F64, I8-I64, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K "
         "(requantize the file with llama.cpp's llama-quantize)";
}

quant::Format ggml_type_format(uint32_t id) {
  const TypeRow* r = find_type(id);
  return r ? r->format : quant::Format::None;
}

GgufFile parse_gguf(std::string_view bytes, uint64_t file_bytes, const std::string& what) {
  Cursor c(bytes, file_bytes, what);
  GgufFile g;
  g.path = what;
  g.file_bytes = file_bytes;
  if (file_bytes < 4 || bytes.size() < 4 || std::memcmp(bytes.data(), "GGUF", 4) != 0)
    LS_FAIL(what, " is not a GGUF file (it does not start with the bytes \"GGUF\")");
  c.take(4, "the magic");
  g.version = c.get<uint32_t>("the version");
  // A big-endian file (gguf-py's GGUFWriter(endianess=BIG), for s390x) reads its
  // version byte-swapped here: say so rather than call it an unknown version.
  const uint32_t swapped = (g.version >> 24) | ((g.version >> 8) & 0xff00u) | ((g.version << 8) & 0xff0000u) |
                           (g.version << 24);
  LS_CHECK(swapped != 2 && swapped != 3, what, " is a big-endian GGUF file (version ", swapped,
           "); layerstream reads little-endian ones: convert it (gguf-py's `gguf-convert-endian FILE little`)");
  LS_CHECK(g.version == 2 || g.version == 3, what, ": GGUF version ", g.version,
           " is not supported (versions 2 and 3 are); convert the file with a recent llama.cpp");
  const uint64_t n_tensors = c.get<uint64_t>("the tensor count");
  const uint64_t n_kv = c.get<uint64_t>("the metadata count");
  // Each record takes at least 8 bytes: counts beyond the file are damage.
  LS_CHECK(n_tensors <= file_bytes / 8 && n_kv <= file_bytes / 8, what, ": header claims ", n_tensors,
           " tensors and ", n_kv, " metadata keys, more than a ", file_bytes, "-byte file can hold");
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.string("a metadata key");
    const uint32_t t = c.get<uint32_t>("a metadata value type");
    std::string v = value_text(c, t, what, key, file_bytes);
    if (key == "general.alignment") {
      LS_CHECK(t == kU32, what, ": general.alignment must be a UINT32, got ", value_type_name(t));
      g.alignment = std::stoull(v);
      LS_CHECK(g.alignment > 0 && (g.alignment & (g.alignment - 1)) == 0, what, ": general.alignment ",
               g.alignment, " is not a power of two");
    }
    g.metadata[key] = std::move(v);
  }
  g.tensors.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    t.name = c.string("a tensor name");
    const std::string where = what + ": tensor '" + t.name + "'";
    const uint32_t nd = c.get<uint32_t>("a tensor's dimension count");
    // 0 dimensions: a scalar (gguf-py writes one for a 0-d tensor, e.g. CLIP's logit_scale).
    LS_CHECK(nd <= 8, where, " has ", nd, " dimensions (0 to 8 are valid)");
    std::vector<uint64_t> dims(nd);
    t.numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      dims[d] = c.get<uint64_t>("a tensor dimension");
      LS_CHECK(dims[d] == 0 || t.numel <= std::numeric_limits<int64_t>::max() / dims[d], where,
               " has too many elements");
      t.numel *= dims[d];
    }
    t.shape.assign(dims.rbegin(), dims.rend());
    t.type = c.get<uint32_t>("a tensor type");
    t.offset = c.get<uint64_t>("a tensor offset");
    const GgmlType ty = ggml_type(t.type);
    LS_CHECK(ty.name != nullptr, where, " has unknown ggml type ", t.type,
             "; the file is newer than this reader");
    t.type_name = ty.name;
    const uint64_t inner = nd ? dims[0] : 1;
    LS_CHECK(inner % ty.block_elems == 0, where, " (", t.type_name, ") has ", inner,
             " elements in its innermost dimension, not a multiple of the block size ", ty.block_elems);
    const uint64_t blocks = t.numel / ty.block_elems;
    LS_CHECK(blocks <= UINT64_MAX / ty.block_bytes, where, " (", t.type_name, ") has ", t.numel,
             " elements: more bytes than fit in 64 bits; the file is damaged");
    t.nbytes = blocks * ty.block_bytes;
    g.tensors.push_back(std::move(t));
  }
  {
    std::map<std::string_view, int> seen;
    for (const GgufTensor& t : g.tensors)
      LS_CHECK(seen[t.name]++ == 0, what, ": tensor '", t.name, "' is named twice in the file; the file is damaged");
  }
  g.data_offset = (c.pos() + g.alignment - 1) / g.alignment * g.alignment;
  // Offsets are relative to the data section; data must be aligned, inside
  // the file, and not overlap.
  std::vector<std::pair<uint64_t, size_t>> order;
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    GgufTensor& t = g.tensors[i];
    const std::string where = what + ": tensor '" + t.name + "'";
    LS_CHECK(t.offset % g.alignment == 0, where, " starts at data offset ", t.offset,
             ", not a multiple of the alignment ", g.alignment);
    LS_CHECK(t.offset <= file_bytes && t.nbytes <= file_bytes - std::min(file_bytes, g.data_offset + t.offset),
             where, " (", t.nbytes, " bytes at data offset ", t.offset, ") runs past the end of the ",
             file_bytes, "-byte file; the file is truncated");
    t.offset += g.data_offset;
    order.emplace_back(t.offset, i);
  }
  std::sort(order.begin(), order.end());
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensor& a = g.tensors[order[k - 1].second];
    const GgufTensor& b = g.tensors[order[k].second];
    LS_CHECK(a.offset + a.nbytes <= b.offset, what, ": tensors '", a.name, "' and '", b.name,
             "' overlap in the file; the file is damaged");
  }
  return g;
}

GgufFile read_gguf(const std::string& path) {
  std::error_code ec;
  auto st = fs::status(path, ec);
  LS_CHECK(!ec && fs::exists(st), "GGUF file '", path, "' does not exist");
  LS_CHECK(!fs::is_directory(st), "'", path, "' is a directory, not a GGUF file");
  // A FIFO would block the reads forever: weights come from regular files only.
  LS_CHECK(fs::is_regular_file(st), "'", path, "' is not a regular file (a FIFO, socket or device); pass the "
           "path of a .gguf file");
  std::ifstream f(path, std::ios::binary);
  LS_CHECK(f.good(), "cannot open GGUF file '", path, "': ", std::strerror(errno));
  f.seekg(0, std::ios::end);
  const std::streamoff size = f.tellg();
  LS_CHECK(size >= 0, "cannot determine the size of '", path, "'");
  const uint64_t file_bytes = static_cast<uint64_t>(size);
  std::string buf;
  uint64_t want = std::min<uint64_t>(file_bytes, uint64_t{1} << 20);
  for (;;) {
    const size_t have = buf.size();
    buf.resize(static_cast<size_t>(want));
    f.clear();
    f.seekg(static_cast<std::streamoff>(have));
    f.read(buf.data() + have, static_cast<std::streamsize>(want - have));
    LS_CHECK(static_cast<uint64_t>(f.gcount()) == want - have, "cannot read '", path,
             "' (file changed while reading?)");
    std::optional<GgufFile> parsed;  // the return outside the try: planner.cpp, Note [No exceptions for the retry]
    try {
      parsed.emplace(parse_gguf(buf, file_bytes, path));
    } catch (const NeedMore&) {
      LS_INTERNAL_CHECK(want < file_bytes);
      want = std::min<uint64_t>(file_bytes, want * 4);
      continue;
    }
    return std::move(*parsed);
  }
}

}  // namespace layerstream
