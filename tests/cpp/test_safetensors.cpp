// safetensors header reader, JSON parser, checkpoint grouping, and a
// randomized fuzz test (LS_FUZZ_ITERS=N for a longer local run).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "core/planner.h"
#include "core/gguf.h"
#include "core/io/source_file.h"
#include "core/safetensors.h"

namespace fs = std::filesystem;
using namespace layerstream;

namespace {

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file image: 8-byte length + header + `data_bytes` zero bytes.
std::string image(const std::string& header, uint64_t data_bytes) {
  return le64(header.size()) + header + std::string(static_cast<size_t>(data_bytes), '\0');
}

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("ls_test_safetensors_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name, const std::string& bytes) const {
    fs::path p = path_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p.string();
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

// The message of the Error thrown by f (fails the test if none / another type).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.message().find('\n'), std::string::npos) << "multi-line message: " << e.message();
    return e.message();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-layerstream exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

std::string parse_err(const std::string& header, uint64_t data_bytes) {
  std::string img = image(header, data_bytes);
  return error_of([&] { parse_safetensors_header(img, img.size(), "m.safetensors"); });
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

const std::string kTwo =
    R"({"__metadata__": {"format": "pt"}, )"
    R"("w.weight": {"dtype": "BF16", "shape": [4, 3], "data_offsets": [0, 24]}, )"
    R"("w.bias": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}})";

}  // namespace

// ------------------------------------------------------------------ JSON

// A FIFO (or device) named as a checkpoint is refused at once: opening and
// reading one blocked forever (until Ctrl-C) when nobody wrote into it.
TEST(SafetensorsFile, AFifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.str() + "/m.safetensors";
  ASSERT_EQ(0, ::mkfifo(fifo.c_str(), 0600));
  const std::string msg = error_of([&] { read_safetensors_header(fifo); });
  EXPECT_NE(msg.find("is not a regular file"), std::string::npos) << msg;
  const std::string gguf = dir.str() + "/m.gguf";
  ASSERT_EQ(0, ::mkfifo(gguf.c_str(), 0600));
  const std::string g = error_of([&] { read_gguf(gguf); });
  EXPECT_NE(g.find("is not a regular file"), std::string::npos) << g;
  const std::string src = error_of([&] { SourceFile::open(fifo); });
  EXPECT_NE(src.find("not a regular file"), std::string::npos) << src;
}

TEST(Json, ParsesValues) {
  json::Value v = json::parse(R"( {"a": [1, -2.5e3, true, false, null], "s": "x\"\\\n\u00e9\ud83d\ude00", "n": 18446744073709551615} )", "t");
  ASSERT_TRUE(v.is_object());
  const json::Value* a = v.find("a");
  ASSERT_TRUE(a && a->is_array());
  ASSERT_EQ(a->array.size(), 5u);
  uint64_t u = 0;
  EXPECT_TRUE(a->array[0].to_uint64(u));
  EXPECT_EQ(u, 1u);
  EXPECT_FALSE(a->array[1].to_uint64(u));
  EXPECT_DOUBLE_EQ(a->array[1].number, -2500.0);
  EXPECT_TRUE(a->array[2].boolean);
  EXPECT_TRUE(a->array[4].is_null());
  EXPECT_EQ(v.find("s")->text, "x\"\\\n\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(v.find("n")->to_uint64(u));
  EXPECT_EQ(u, UINT64_MAX);
}

TEST(Json, RejectsMalformed) {
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "{\"a\":1,}", "01", "1.", "-", "tru", "\"\\x\"",
                          "\"\\ud800\"", "\"a\nb\"", "{} x", "{\"a\":1,\"a\":2}", "\"unterminated", "nan"}) {
    std::string msg = error_of([&] { json::parse(bad, "input"); });
    EXPECT_HAS(msg, "input: bad JSON at byte");
  }
  uint64_t u;
  EXPECT_FALSE(json::parse("18446744073709551616", "t").to_uint64(u));  // overflow
}

// JSON text is UTF-8: a string with bytes that are not (a damaged header) is an
// error naming the input, not a name that cannot be given back to Python.
TEST(Json, StringsMustBeUtf8) {
  EXPECT_EQ(json::parse("\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"", "t").text,
            "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  for (const char* bad : {"\"a\xff\"", "\"\xc3\"", "\"\xc0\xaf\"", "\"\xe0\x80\xaf\"", "\"\xed\xa0\x80\"",
                          "\"\xf4\x90\x80\x80\"", "\"\xe2\x82\""}) {
    const std::string msg = error_of([&] { json::parse(bad, "input"); });
    EXPECT_HAS(msg, "input: bad JSON at byte");
    EXPECT_HAS(msg, "invalid UTF-8");
  }
  EXPECT_TRUE(json::valid_utf8("plain \xc3\xa9"));
  EXPECT_FALSE(json::valid_utf8("\xc3"));
}

TEST(Json, DeepNestingIsAnErrorNotACrash) {
  std::string deep(100000, '[');
  EXPECT_HAS(error_of([&] { json::parse(deep, "deep"); }), "nesting deeper");
  std::string ok = std::string(json::kMaxDepth - 1, '[') + std::string(json::kMaxDepth - 1, ']');
  EXPECT_NO_THROW(json::parse(ok, "ok"));
}

TEST(Json, QuoteIsOneLine) {
  EXPECT_EQ(json::quote("a\nb\"\x01\xff"), "\"a\\nb\\\"\\u0001\\u00ff\"");
}

// ------------------------------------------------------------ header reader

TEST(Safetensors, ReadsValidHeader) {
  TempDir d;
  std::string p = d.file("m.safetensors", image(kTwo, 40));
  SafetensorsHeader h = read_safetensors_header(p);
  EXPECT_EQ(h.path, p);
  EXPECT_EQ(h.file_bytes, 8 + kTwo.size() + 40);
  EXPECT_EQ(h.header_bytes, kTwo.size());
  EXPECT_EQ(h.data_offset, 8 + kTwo.size());
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "w.weight");
  EXPECT_EQ(h.tensors[0].dtype, "BF16");
  EXPECT_EQ(h.tensors[0].shape, (std::vector<uint64_t>{4, 3}));
  EXPECT_EQ(h.tensors[0].begin, 0u);
  EXPECT_EQ(h.tensors[0].end, 24u);
  EXPECT_EQ(h.tensors[0].numel, 12u);
  EXPECT_EQ(h.tensors[0].nbytes, 24u);
  EXPECT_EQ(h.tensors[1].nbytes, 16u);
  EXPECT_EQ(h.tensors[1].file, p);
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(Safetensors, ScalarsEmptyTensorsPaddingAndSubByteDtypes) {
  std::string hdr =
      R"({"s": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]},)"
      R"( "e": {"dtype": "F16", "shape": [0, 7], "data_offsets": [8, 8]},)"
      R"( "f4": {"dtype": "F4", "shape": [2, 3], "data_offsets": [8, 11]},)"
      R"( "z": {"dtype": "F8_E5M2", "shape": [5], "data_offsets": [11, 16]}}      )";  // trailing pad
  std::string img = image(hdr, 20);  // 4 bytes of slack at the end are tolerated
  SafetensorsHeader h = parse_safetensors_header(img, img.size(), "x");
  ASSERT_EQ(h.tensors.size(), 4u);
  EXPECT_EQ(h.tensors[0].numel, 1u);
  EXPECT_EQ(h.tensors[1].nbytes, 0u);
  EXPECT_EQ(h.tensors[2].nbytes, 3u);
}

TEST(Safetensors, ReadsRealFilesFromCorpus) {
  std::string dir = std::string(LS_TEST_DATA_DIR) + "/safetensors/corpus/";
  SafetensorsHeader h = read_safetensors_header(dir + "valid_small.safetensors");
  EXPECT_EQ(h.tensors.size(), 5u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  SafetensorsHeader d = read_safetensors_header(dir + "valid_dtypes.safetensors");
  EXPECT_EQ(d.tensors.size(), 3u);
}

TEST(Safetensors, FileLevelErrors) {
  TempDir d;
  std::string p = d.file("short.safetensors", "abc");
  std::string m = error_of([&] { read_safetensors_header(p); });
  EXPECT_HAS(m, "short.safetensors");
  EXPECT_HAS(m, "too short");

  p = d.file("past.safetensors", le64(1000) + "{}");
  m = error_of([&] { read_safetensors_header(p); });
  EXPECT_HAS(m, "past.safetensors");
  EXPECT_HAS(m, "header length 1000 bytes runs past the end of the file (10 bytes)");

  p = d.file("absurd.safetensors", le64(1ull << 40) + "{}");
  EXPECT_HAS(error_of([&] { read_safetensors_header(p); }), "is absurd");

  p = d.file("zero.safetensors", le64(0));
  EXPECT_HAS(error_of([&] { read_safetensors_header(p); }), "too small to hold a JSON object");

  EXPECT_HAS(error_of([&] { read_safetensors_header(d.str() + "/missing.safetensors"); }), "does not exist");
  EXPECT_HAS(error_of([&] { read_safetensors_header(d.str()); }), "is a directory");
}

TEST(Safetensors, HeaderErrors) {
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [1], )", 4), "m.safetensors header: bad JSON at byte");
  EXPECT_HAS(parse_err(R"([1, 2])", 0), "does not start with '{'");
  EXPECT_HAS(parse_err(R"({"a": 1})", 0), "tensor \"a\": entry must be an object");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}})", 4),
             "m.safetensors: tensor \"a\": unknown dtype \"Q7\" (known: F64, F32");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": 32, "shape": [1], "data_offsets": [0, 4]}})", 4),
             "\"dtype\" must be a string");
  EXPECT_HAS(parse_err(R"({"a": {"shape": [1], "data_offsets": [0, 4]}})", 4), "tensor \"a\": missing \"dtype\"");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "data_offsets": [0, 4]}})", 4), "missing \"shape\"");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [1]}})", 4), "missing \"data_offsets\"");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4),
             "\"shape\" entries must be non-negative integers, got -1");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4),
             "non-negative integers, got 1.5");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 4]}})", 4),
             "tensor \"a\": data_offsets [0, 4] span 4 bytes but shape [2, 3] of F32 needs 24 bytes");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8),
             "end before they begin");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4),
             "tensor \"a\": data_offsets [0, 8] run past the end of the file (the data buffer has 4 bytes)");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", 8),
             "must be an array [begin, end]");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                       R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                       12),
             "tensors \"a\" [0, 8) and \"b\" [4, 12) overlap");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0),
             "more elements than fit in 64 bits");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})", 2),
             "does not fill whole bytes");
  EXPECT_HAS(parse_err(R"({"__metadata__": {"k": 1}})", 0), "\"__metadata__\" value for \"k\" must be a string");
  EXPECT_HAS(parse_err(R"({"__metadata__": [1]})", 0), "\"__metadata__\" must be an object");
  EXPECT_HAS(parse_err(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": 1})", 4),
             "duplicate key \"a\"");
  EXPECT_HAS(parse_err(R"({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 4), "empty name");
  // Names with control characters are quoted so the message stays one line.
  EXPECT_HAS(parse_err("{\"a\\nb\": {\"dtype\": \"X\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4),
             "tensor \"a\\nb\"");
}

// ------------------------------------------------------------ checkpoints

namespace {
std::string tensor_json(const std::string& name, const std::string& dtype, std::vector<uint64_t> shape, uint64_t begin,
                        uint64_t bytes) {
  std::string s = json::quote(name) + ": {\"dtype\": \"" + dtype + "\", \"shape\": [";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "], \"data_offsets\": [" + std::to_string(begin) + ", " + std::to_string(begin + bytes) + "]}";
}
}  // namespace

TEST(Checkpoint, SingleFileAndDirectory) {
  TempDir d;
  std::string p = d.file("model/model.safetensors", image(kTwo, 40));
  Checkpoint a = read_checkpoint(p);
  EXPECT_EQ(a.files, std::vector<std::string>{p});
  EXPECT_EQ(a.tensors.size(), 2u);
  EXPECT_EQ(a.total_bytes(), 40u);
  Checkpoint b = read_checkpoint(d.str() + "/model");
  EXPECT_EQ(b.tensors.size(), 2u);
  d.file("model/other.safetensors", image(kTwo, 40));
  EXPECT_HAS(error_of([&] { read_checkpoint(d.str() + "/model"); }), "holds 2 .safetensors files and no index json");
  fs::create_directories(d.str() + "/empty");
  EXPECT_HAS(error_of([&] { read_checkpoint(d.str() + "/empty"); }), "holds no .safetensors file");
  EXPECT_HAS(error_of([&] { read_checkpoint(d.str() + "/nope"); }), "does not exist");
}

TEST(Checkpoint, IndexJsonMultiFile) {
  TempDir d;
  std::string h1 = "{" + tensor_json("layers.0.w.weight", "F16", {4, 4}, 0, 32) + ", " +
                   tensor_json("layers.0.w.bias", "F16", {4}, 32, 8) + "}";
  std::string h2 = "{" + tensor_json("layers.1.w.weight", "F16", {4, 4}, 0, 32) + ", " +
                   tensor_json("norm.weight", "F32", {4}, 32, 16) + "}";
  d.file("ck/model-00001-of-00002.safetensors", image(h1, 40));
  d.file("ck/model-00002-of-00002.safetensors", image(h2, 48));
  std::string idx = d.file("ck/model.safetensors.index.json",
                           R"({"metadata": {"total_size": 88}, "weight_map": {)"
                           R"("layers.0.w.weight": "model-00001-of-00002.safetensors",)"
                           R"("layers.0.w.bias": "model-00001-of-00002.safetensors",)"
                           R"("layers.1.w.weight": "model-00002-of-00002.safetensors",)"
                           R"("norm.weight": "model-00002-of-00002.safetensors"}})");
  for (const std::string& path : {idx, d.str() + "/ck"}) {
    Checkpoint c = read_checkpoint(path);
    EXPECT_EQ(c.index_path, idx);
    ASSERT_EQ(c.files.size(), 2u);
    EXPECT_EQ(c.tensors.size(), 4u);
    EXPECT_EQ(c.total_bytes(), 88u);
    ModelDescription m = describe_checkpoint(c);
    ASSERT_EQ(m.layers.size(), 2u);
    EXPECT_EQ(m.layers[0].name, "layers.0.w");
    EXPECT_EQ(m.layers[0].bias_numel, 4u);
    EXPECT_EQ(m.layers[1].name, "layers.1.w");
    EXPECT_EQ(m.small_tensors, 1u);
    EXPECT_EQ(m.small_bytes, 16u);
  }

  std::string bad = d.file("bad/a.safetensors.index.json", R"({"weight_map": {"x": "missing.safetensors"}})");
  EXPECT_HAS(error_of([&] { read_checkpoint(bad); }), "shard \"missing.safetensors\" listed in \"weight_map\" does not exist");
  d.file("bad2/s.safetensors", image(h1, 40));
  bad = d.file("bad2/a.safetensors.index.json", R"({"weight_map": {"nope": "s.safetensors"}})");
  EXPECT_HAS(error_of([&] { read_checkpoint(bad); }), "puts tensor \"nope\" in \"s.safetensors\" but that file has no such tensor");
  d.file("dup/s1.safetensors", image(h1, 40));
  d.file("dup/s2.safetensors", image(h1, 40));
  bad = d.file("dup/a.safetensors.index.json",
               R"({"weight_map": {"layers.0.w.weight": "s1.safetensors", "layers.0.w.bias": "s2.safetensors"}})");
  EXPECT_HAS(error_of([&] { read_checkpoint(bad); }), "appears in both");
  bad = d.file("bad3/a.safetensors.index.json", R"({"weight_map": {}})");
  EXPECT_HAS(error_of([&] { read_checkpoint(bad); }), "\"weight_map\" is empty");
  bad = d.file("bad4/a.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  EXPECT_HAS(error_of([&] { read_checkpoint(bad); }), "must be a non-empty file name");
  bad = d.file("bad5/a.safetensors.index.json", R"({"weight_map": )");
  EXPECT_HAS(error_of([&] { read_checkpoint(bad); }), "bad JSON");
}

TEST(Checkpoint, GroupsLayersInNaturalOrder) {
  std::string h = "{" + tensor_json("m.layers.10.fc.weight", "BF16", {2, 2}, 0, 8) + ", " +
                  tensor_json("m.layers.2.fc.weight", "BF16", {2, 2}, 8, 8) + ", " +
                  tensor_json("m.layers.2.fc.bias", "BF16", {2}, 16, 4) + ", " +
                  tensor_json("m.embed_tokens.weight", "BF16", {8, 2}, 20, 32) + ", " +
                  tensor_json("m.norm.weight", "BF16", {2}, 52, 4) + ", " +
                  tensor_json("m.orphan.bias", "BF16", {2}, 56, 4) + "}";
  TempDir d;
  Checkpoint c = read_checkpoint(d.file("x.safetensors", image(h, 60)));
  ModelDescription m = describe_checkpoint(c);
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].name, "m.embed_tokens");
  EXPECT_TRUE(m.layers[0].embedding);
  EXPECT_EQ(m.layers[1].name, "m.layers.2.fc");
  EXPECT_EQ(m.layers[1].stored_bytes(), 12u);
  EXPECT_EQ(m.layers[2].name, "m.layers.10.fc");
  EXPECT_EQ(m.small_tensors, 2u);
  EXPECT_EQ(m.small_bytes, 8u);
}

// ------------------------------------------------------------ corpus replay

namespace {
// Replays every input file of `dir` (not README.md / expected.tsv); returns how many
// it replayed. A missing folder is a failure (a moved data folder must not turn the
// replay into a no-op). `expected.tsv` (file TAB message fragment), when present,
// names the error each listed file must be refused with.
int replay_dir(const std::string& dir, bool crashers) {
  if (!fs::is_directory(dir)) {
    ADD_FAILURE() << "test data folder " << dir << " is missing";
    return 0;
  }
  std::map<std::string, std::string> expected;
  {
    std::ifstream f(dir + "/expected.tsv");
    std::string line;
    while (std::getline(f, line)) {
      const size_t tab = line.find('\t');
      if (tab != std::string::npos) expected[line.substr(0, tab)] = line.substr(tab + 1);
    }
  }
  int replayed = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file() || e.path().extension() == ".md" || e.path().filename() == "expected.tsv") continue;
    std::string name = e.path().filename().string();
    SCOPED_TRACE(name);
    ++replayed;
    bool expect_ok = !crashers && name.rfind("valid_", 0) == 0;
    const auto want = expected.find(name);
    try {
      SafetensorsHeader h = read_safetensors_header(e.path().string());
      if (!expect_ok && !crashers) ADD_FAILURE() << "expected an error for " << name;
      if (want != expected.end()) ADD_FAILURE() << name << " parsed; expected the error \"" << want->second << "\"";
    } catch (const Error& err) {
      EXPECT_FALSE(expect_ok) << err.message();
      EXPECT_EQ(err.message().find('\n'), std::string::npos);
      if (want != expected.end()) {
        EXPECT_NE(err.message().find(want->second), std::string::npos) << err.message();
      }
    } catch (...) {
      ADD_FAILURE() << "non-layerstream exception for " << name;
    }
  }
  for (const auto& [name, msg] : expected)
    EXPECT_TRUE(fs::exists(dir + "/" + name)) << "expected.tsv lists " << name << ", which is missing";
  return replayed;
}
}  // namespace

TEST(Safetensors, CorpusReplay) {
  // 2 valid_* files and 5 that must be refused (tests/cpp/data/safetensors/corpus/README.md)
  EXPECT_EQ(replay_dir(std::string(LS_TEST_DATA_DIR) + "/safetensors/corpus", false), 7);
}

// Hostile inputs (and every input the fuzzer ever crashed on), kept as a regression test.
TEST(Safetensors, CrashersReplay) {
  EXPECT_GE(replay_dir(std::string(LS_TEST_DATA_DIR) + "/safetensors/crashers", true), 8);
}

// ------------------------------------------------------------ fuzzing

namespace {

std::string random_header(std::mt19937_64& rng, uint64_t& data_bytes) {
  static const char* dtypes[] = {"F32", "F16", "BF16", "I8", "U8", "BOOL", "F8_E4M3", "I64", "F4", "F64"};
  std::string h = "{";
  if (rng() % 3 == 0) h += R"("__metadata__": {"format": "pt", "k": "v"}, )";
  int n = static_cast<int>(rng() % 6);
  uint64_t off = 0;
  for (int i = 0; i < n; ++i) {
    const char* dt = dtypes[rng() % 10];
    unsigned bits = safetensors_dtype_bits(dt);
    std::vector<uint64_t> shape;
    int rank = static_cast<int>(rng() % 4);
    uint64_t numel = 1;
    for (int r = 0; r < rank; ++r) {
      shape.push_back(rng() % 5);
      numel *= shape.back();
    }
    if (bits == 4 && numel % 2) {
      shape.assign(1, 2);
      numel = 2;
    }
    uint64_t bytes = numel * bits / 8;
    h += (i ? ", " : "") + tensor_json("t" + std::to_string(i) + ".weight", dt, shape, off, bytes);
    off += bytes + (rng() % 4 == 0 ? rng() % 3 : 0);
  }
  h += "}";
  if (rng() % 4 == 0) h += std::string(rng() % 8, ' ');
  data_bytes = off + rng() % 3;
  return h;
}

std::string random_json_soup(std::mt19937_64& rng) {
  static const char* toks[] = {"{", "}", "[", "]", ",", ":", "\"dtype\"", "\"shape\"", "\"data_offsets\"",
                               "\"F32\"", "\"__metadata__\"", "0", "1", "-1", "1e400", "18446744073709551616",
                               "\"a\"", "true", "null", "\"\\u", "\"\\ud800\"", " ", "\"x", "99999999999", "\\"};
  std::string s;
  int n = static_cast<int>(rng() % 40);
  for (int i = 0; i < n; ++i) s += toks[rng() % (sizeof toks / sizeof *toks)];
  return s;
}

std::string mutate(std::mt19937_64& rng, std::string img) {
  int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 8) {
      case 0:  // bit flip
        if (!img.empty()) img[rng() % img.size()] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // random byte
        if (!img.empty()) img[rng() % img.size()] = static_cast<char>(rng());
        break;
      case 2:  // truncate
        img.resize(img.empty() ? 0 : rng() % img.size());
        break;
      case 3: {  // random header length
        uint64_t choices[] = {0, 1, 2, rng() % 512, img.size() > 8 ? img.size() - 8 : 0,
                              img.size() > 7 ? img.size() - 7 : 0, kMaxHeaderBytes, kMaxHeaderBytes + 1,
                              UINT64_MAX, rng()};
        std::string len = le64(choices[rng() % 10]);
        if (img.size() < 8) img.resize(8);
        img.replace(0, 8, len);
        break;
      }
      case 4:  // insert bytes
        img.insert(img.empty() ? 0 : rng() % img.size(), std::string(1 + rng() % 4, static_cast<char>(rng())));
        break;
      case 5:  // delete a range
        if (img.size() > 1) {
          size_t at = rng() % img.size();
          img.erase(at, 1 + rng() % std::min<size_t>(16, img.size() - at));
        }
        break;
      case 6: {  // swap in a digit string (offsets/shapes)
        static const char* nums[] = {"0", "18446744073709551615", "4294967296", "-0", "1e3", "7"};
        size_t at = img.find_first_of("0123456789", 8 + rng() % std::max<size_t>(1, img.size()));
        if (at != std::string::npos) img.replace(at, 1, nums[rng() % 6]);
        break;
      }
      default: {  // keep length consistent after edits
        if (img.size() >= 8) img.replace(0, 8, le64(img.size() - 8 - (rng() % 2 ? 0 : rng() % 8)));
      }
    }
  }
  return img;
}

}  // namespace

TEST(SafetensorsFuzz, OnlyEverThrowsLayerstreamError) {
  uint64_t iters = 60000;
  if (const char* env = std::getenv("LS_FUZZ_ITERS")) iters = std::strtoull(env, nullptr, 10);
  uint64_t seed = 12345;
  if (const char* env = std::getenv("LS_FUZZ_SEED")) seed = std::strtoull(env, nullptr, 10);
  std::mt19937_64 rng(seed);
  std::vector<std::string> seeds;
  std::string corpus = std::string(LS_TEST_DATA_DIR) + "/safetensors/corpus";
  for (const auto& e : fs::directory_iterator(corpus)) {
    std::ifstream f(e.path(), std::ios::binary);
    seeds.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  TempDir d;
  uint64_t ok = 0, errors = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (uint64_t it = 0; it < iters; ++it) {
    std::string img;
    uint64_t data_bytes = 0;
    switch (rng() % 4) {
      case 0: img = image(random_header(rng, data_bytes), data_bytes); break;
      case 1: img = mutate(rng, image(random_header(rng, data_bytes), data_bytes)); break;
      case 2: img = mutate(rng, seeds[rng() % seeds.size()]); break;
      default: {
        std::string soup = random_json_soup(rng);
        img = image(soup, rng() % 64);
        if (rng() % 2) img = mutate(rng, img);
      }
    }
    try {
      // In memory (fast), and every 64th through a real file.
      if (it % 64 == 0) {
        read_safetensors_header(d.file("f.safetensors", img));
      } else {
        parse_safetensors_header(img, img.size(), "fuzz");
      }
      ++ok;
    } catch (const Error& e) {
      ++errors;
      if (e.message().find('\n') != std::string::npos) {
        d.file("../ls_fuzz_multiline_" + std::to_string(it) + ".safetensors", img);
        FAIL() << "multi-line error message at iteration " << it << ": " << e.message();
      }
    } catch (const std::exception& e) {
      std::string keep = d.file("../ls_fuzz_crasher_" + std::to_string(it) + ".safetensors", img);
      FAIL() << "iteration " << it << " threw a non-layerstream exception: " << e.what() << " (input kept at " << keep
             << ")";
    }
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("fuzz: %llu iterations in %.1f s (seed %llu): %llu valid, %llu rejected\n",
              static_cast<unsigned long long>(iters), secs, static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(ok), static_cast<unsigned long long>(errors));
  EXPECT_GT(ok, 0u);
  EXPECT_GT(errors, 0u);
}
