#include "safetensors.h"

#include <algorithm>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <system_error>

#include "error.h"
#include "json.h"

namespace layerstream {

namespace fs = std::filesystem;

namespace {

struct DTypeEntry {
  const char* name;
  unsigned bits;
  bool wide_float;
};

constexpr DTypeEntry kDTypes[] = {
    {"F64", 64, true},     {"F32", 32, true},      {"F16", 16, true},      {"BF16", 16, true},
    {"I64", 64, false},    {"I32", 32, false},     {"I16", 16, false},     {"I8", 8, false},
    {"U64", 64, false},    {"U32", 32, false},     {"U16", 16, false},     {"U8", 8, false},
    {"BOOL", 8, false},    {"F8_E4M3", 8, false},  {"F8_E5M2", 8, false},  {"F8_E8M0", 8, false},
    {"F6_E2M3", 6, false}, {"F6_E3M2", 6, false},  {"F4", 4, false},       {"C64", 64, false},
};

const DTypeEntry* find_dtype(std::string_view name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

std::string q(std::string_view s) { return json::quote(s); }

std::string shape_str(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

TensorInfo parse_tensor_entry(const std::string& what, const std::string& name, const json::Value& v,
                              uint64_t data_bytes) {
  const std::string where = what + ": tensor " + q(name);
  LS_CHECK(!name.empty(), what, ": header has a tensor with an empty name");
  LS_CHECK(v.is_object(), where, ": entry must be an object with dtype, shape and data_offsets, got ",
           json::to_string(v.type));
  TensorInfo t;
  t.name = name;

  const json::Value* dtype = v.find("dtype");
  LS_CHECK(dtype, where, ": missing \"dtype\"");
  LS_CHECK(dtype->is_string(), where, ": \"dtype\" must be a string, got ", json::to_string(dtype->type));
  const DTypeEntry* dt = find_dtype(dtype->text);
  LS_CHECK(dt, where, ": unknown dtype ", q(dtype->text), " (known: ", safetensors_known_dtypes(), ")");
  t.dtype = dtype->text;

  const json::Value* shape = v.find("shape");
  LS_CHECK(shape, where, ": missing \"shape\"");
  LS_CHECK(shape->is_array(), where, ": \"shape\" must be an array of non-negative integers, got ",
           json::to_string(shape->type));
  bool overflow = false, zero = false;
  uint64_t numel = 1;
  for (const auto& d : shape->array) {
    uint64_t n = 0;
    LS_CHECK(d.to_uint64(n), where, ": \"shape\" entries must be non-negative integers, got ",
             d.is_number() ? d.text : std::string(json::to_string(d.type)));
    t.shape.push_back(n);
    if (n == 0) zero = true;
    if (!overflow && n != 0) {
      if (numel > UINT64_MAX / n)
        overflow = true;
      else
        numel *= n;
    }
  }
  if (zero) {
    numel = 0;
    overflow = false;
  }
  LS_CHECK(!overflow, where, ": shape ", shape_str(t.shape), " has more elements than fit in 64 bits");
  LS_CHECK(numel <= UINT64_MAX / dt->bits, where, ": shape ", shape_str(t.shape), " of ", t.dtype,
           " is larger than 2^64 bytes");
  uint64_t bits = numel * dt->bits;
  LS_CHECK(bits % 8 == 0, where, ": shape ", shape_str(t.shape), " of ", t.dtype, " (", dt->bits,
           "-bit) does not fill whole bytes");
  t.numel = numel;
  t.nbytes = bits / 8;

  const json::Value* offs = v.find("data_offsets");
  LS_CHECK(offs, where, ": missing \"data_offsets\"");
  LS_CHECK(offs->is_array() && offs->array.size() == 2, where,
           ": \"data_offsets\" must be an array [begin, end] of two integers");
  LS_CHECK(offs->array[0].to_uint64(t.begin) && offs->array[1].to_uint64(t.end), where,
           ": \"data_offsets\" must be non-negative integers");
  LS_CHECK(t.begin <= t.end, where, ": data_offsets [", t.begin, ", ", t.end, "] end before they begin");
  LS_CHECK(t.end - t.begin == t.nbytes, where, ": data_offsets [", t.begin, ", ", t.end, "] span ",
           t.end - t.begin, " bytes but shape ", shape_str(t.shape), " of ", t.dtype, " needs ", t.nbytes,
           " bytes");
  LS_CHECK(t.end <= data_bytes, where, ": data_offsets [", t.begin, ", ", t.end,
           "] run past the end of the file (the data buffer has ", data_bytes, " bytes)");
  return t;
}

}  // namespace

unsigned safetensors_dtype_bits(std::string_view dtype) {
  const DTypeEntry* d = find_dtype(dtype);
  return d ? d->bits : 0;
}

bool safetensors_dtype_is_wide_float(std::string_view dtype) {
  const DTypeEntry* d = find_dtype(dtype);
  return d && d->wide_float;
}

std::string safetensors_known_dtypes() {
  std::string s;
  for (const auto& d : kDTypes) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

SafetensorsHeader parse_safetensors_header(std::string_view bytes, uint64_t file_bytes,
                                           const std::string& what) {
  SafetensorsHeader h;
  h.path = what;
  h.file_bytes = file_bytes;
  LS_CHECK(file_bytes >= 8, what, ": file is too short to be a safetensors file (", file_bytes,
           " bytes; it must start with an 8-byte header length)");
  LS_INTERNAL_CHECK(bytes.size() >= 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  h.header_bytes = n;
  LS_CHECK(n <= kMaxHeaderBytes, what, ": header length ", n, " bytes is absurd (limit ", kMaxHeaderBytes,
           "); the file is not a safetensors file or is corrupt");
  LS_CHECK(n <= file_bytes - 8, what, ": header length ", n, " bytes runs past the end of the file (",
           file_bytes, " bytes); the file is truncated or not a safetensors file");
  LS_CHECK(n >= 2, what, ": header length ", n, " bytes is too small to hold a JSON object");
  LS_INTERNAL_CHECK(bytes.size() >= 8 + n);
  h.data_offset = 8 + n;
  const uint64_t data_bytes = file_bytes - h.data_offset;

  std::string_view text = bytes.substr(8, n);
  LS_CHECK(text[0] == '{', what, ": header does not start with '{' (not a safetensors file?)");
  json::Value root = json::parse(text, what + " header");
  LS_CHECK(root.is_object(), what, ": header must be a JSON object");

  std::set<std::string> names;
  for (const auto& [key, v] : root.object) {
    if (key == "__metadata__") {
      LS_CHECK(v.is_object(), what, ": \"__metadata__\" must be an object of strings, got ",
               json::to_string(v.type));
      for (const auto& [mk, mv] : v.object) {
        LS_CHECK(mv.is_string(), what, ": \"__metadata__\" value for ", q(mk), " must be a string, got ",
                 json::to_string(mv.type));
        h.metadata[mk] = mv.text;
      }
      continue;
    }
    h.tensors.push_back(parse_tensor_entry(what, key, v, data_bytes));
    h.tensors.back().file = what;
    h.tensors.back().file_offset = 8 + n + h.tensors.back().begin;
  }

  // Overlap check: sort non-empty tensors by offsets; each must start at or
  // after the end of the one before.
  std::vector<const TensorInfo*> order;
  for (const auto& t : h.tensors)
    if (t.nbytes > 0) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    if (a->begin != b->begin) return a->begin < b->begin;
    if (a->end != b->end) return a->end < b->end;
    return a->name < b->name;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const TensorInfo* a = order[i - 1];
    const TensorInfo* b = order[i];
    LS_CHECK(b->begin >= a->end, what, ": tensors ", q(a->name), " [", a->begin, ", ", a->end, ") and ",
             q(b->name), " [", b->begin, ", ", b->end, ") overlap");
  }
  return h;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::error_code ec;
  auto st = fs::status(path, ec);
  LS_CHECK(!ec && fs::exists(st), "safetensors file ", q(path), " does not exist");
  LS_CHECK(!fs::is_directory(st), q(path), " is a directory, not a safetensors file");
  // A FIFO or a device would block the open or the reads (forever, for a FIFO
  // nobody writes): weights come from regular files only.
  LS_CHECK(fs::is_regular_file(st), q(path), " is not a regular file (a FIFO, socket or device); pass the path "
           "of a .safetensors file");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  LS_CHECK(fd >= 0, "cannot open safetensors file ", q(path), ": ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  // The identity of the file whose header this is: later reads check that the
  // path still names it (core/io/source_file.h).
  const FileIdentity identity = FileIdentity::of(fd, path);
  const uint64_t file_bytes = identity.size;
  auto read_at = [&](char* dst, uint64_t bytes, uint64_t at) {
    uint64_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd, dst + done, static_cast<size_t>(bytes - done), static_cast<off_t>(at + done));
      if (n < 0 && errno == EINTR) continue;
      LS_CHECK(n > 0, "cannot read the header of ", q(path), ": ",
               n < 0 ? std::strerror(errno) : "the file ended early (file changed while reading?)");
      done += static_cast<uint64_t>(n);
    }
  };
  std::string buf(static_cast<size_t>(std::min<uint64_t>(file_bytes, 8)), '\0');
  read_at(buf.data(), buf.size(), 0);
  if (buf.size() == 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(buf[static_cast<size_t>(i)]);
    if (n <= kMaxHeaderBytes && n <= file_bytes - 8) {
      buf.resize(8 + static_cast<size_t>(n));
      read_at(buf.data() + 8, n, 8);
    }
  }
  SafetensorsHeader h = parse_safetensors_header(buf, file_bytes, path);
  h.identity = identity;
  for (TensorInfo& t : h.tensors) t.identity = identity;
  return h;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t s = 0;
  for (const auto& t : tensors) s += t.nbytes;
  return s;
}

namespace {

void add_file(Checkpoint& ck, const SafetensorsHeader& h, std::map<std::string, std::string>& owner) {
  ck.files.push_back(h.path);
  for (const auto& t : h.tensors) {
    auto [it, inserted] = owner.emplace(t.name, h.path);
    LS_CHECK(inserted, "checkpoint ", q(ck.path), ": tensor ", q(t.name), " appears in both ", q(it->second),
             " and ", q(h.path));
    ck.tensors.push_back(t);
    ck.tensors.back().file = h.path;
    ck.tensors.back().identity = h.identity;
  }
  for (const auto& [k, v] : h.metadata) ck.metadata.emplace(k, v);
}

Checkpoint read_index(const std::string& user_path, const std::string& index_path) {
  Checkpoint ck;
  ck.path = user_path;
  ck.index_path = index_path;
  std::ifstream f(index_path, std::ios::binary);
  LS_CHECK(f.good(), "cannot open index file ", q(index_path), ": ", std::strerror(errno));
  f.seekg(0, std::ios::end);
  std::streamoff size = f.tellg();
  LS_CHECK(size >= 0, "cannot determine the size of ", q(index_path));
  LS_CHECK(static_cast<uint64_t>(size) <= kMaxHeaderBytes, "index file ", q(index_path), " is ", size,
           " bytes, more than the ", kMaxHeaderBytes, "-byte limit");
  f.seekg(0, std::ios::beg);
  std::string text(static_cast<size_t>(size), '\0');
  if (size > 0) f.read(text.data(), size);
  LS_CHECK(static_cast<std::streamoff>(f.gcount()) == size, "cannot read index file ", q(index_path));

  json::Value root = json::parse(text, index_path);
  LS_CHECK(root.is_object(), index_path, ": an index must be a JSON object with a \"weight_map\"");
  const json::Value* wm = root.find("weight_map");
  LS_CHECK(wm, index_path, ": missing \"weight_map\"");
  LS_CHECK(wm->is_object(), index_path, ": \"weight_map\" must be an object of tensor name -> file name");
  LS_CHECK(!wm->object.empty(), index_path, ": \"weight_map\" is empty");

  const fs::path dir = fs::path(index_path).parent_path();
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> shard_path;  // name in index -> resolved path
  for (const auto& [tensor, file] : wm->object) {
    LS_CHECK(file.is_string() && !file.text.empty(), index_path, ": \"weight_map\" entry for ", q(tensor),
             " must be a non-empty file name");
    if (!shard_path.count(file.text)) {
      shard_names.push_back(file.text);
      shard_path[file.text] = (dir / file.text).string();
    }
  }
  std::map<std::string, std::string> owner;
  std::map<std::string, std::set<std::string>> names_in_shard;
  for (const auto& name : shard_names) {
    const std::string& p = shard_path[name];
    std::error_code ec;
    LS_CHECK(fs::exists(p, ec), index_path, ": shard ", q(name), " listed in \"weight_map\" does not exist (",
             q(p), ")");
    SafetensorsHeader h = read_safetensors_header(p);
    for (const auto& t : h.tensors) names_in_shard[name].insert(t.name);
    add_file(ck, h, owner);
  }
  for (const auto& [tensor, file] : wm->object) {
    LS_CHECK(names_in_shard[file.text].count(tensor), index_path, ": \"weight_map\" puts tensor ", q(tensor),
             " in ", q(file.text), " but that file has no such tensor");
  }
  return ck;
}

// A diffusers pipeline's root (model_index.json beside a folder per
// component) is not one model's checkpoint: an error listing the component
// folders that hold weights, with their class from model_index.json.
void check_not_a_pipeline(const std::string& path) {
  std::error_code ec;
  const fs::path root(path);
  if (!fs::exists(root / "model_index.json", ec)) return;
  json::Value index;
  try {
    std::ifstream f(root / "model_index.json", std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    index = json::parse(text, (root / "model_index.json").string());
  } catch (const Error&) {
    // Unreadable: the folders are still listed, without classes.
  }
  std::vector<std::string> parts;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory(ec)) continue;
    bool weights = false;
    for (const auto& f : fs::directory_iterator(e.path(), ec))
      weights = weights || ends_with(f.path().filename().string(), ".safetensors") ||
                ends_with(f.path().filename().string(), ".safetensors.index.json");
    if (!weights) continue;
    std::string part = "'" + e.path().string() + "'";
    const json::Value* entry = index.find(e.path().filename().string());  // ["diffusers", "AutoencoderKL"]
    if (entry && entry->is_array() && !entry->array.empty() && entry->array.back().is_string())
      part += " (" + entry->array.back().text + ")";
    parts.push_back(part);
  }
  std::sort(parts.begin(), parts.end());
  std::string list;
  for (const auto& p : parts) list += (list.empty() ? "" : ", ") + p;
  LS_FAIL(q(path), " is a diffusers pipeline (it holds model_index.json), not one model's checkpoint; pass the "
          "folder of one component: ", list.empty() ? "(none of its folders holds a .safetensors file)" : list);
}

}  // namespace

Checkpoint read_checkpoint(const std::string& named) {
  std::error_code ec;
  // Absolute: the files are read again later, after the working directory may have changed.
  const std::string path = named.empty() ? named : fs::absolute(named, ec).string();
  LS_CHECK(!ec, "checkpoint ", q(named), ": cannot make the path absolute: ", ec.message());
  auto st = fs::status(path, ec);
  LS_CHECK(!ec && fs::exists(st), "checkpoint ", q(path), " does not exist");
  if (fs::is_directory(st)) {
    check_not_a_pipeline(path);
    std::vector<std::string> indexes, files, variants;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      if (!e.is_regular_file(ec)) continue;
      std::string name = e.path().filename().string();
      if (ends_with(name, ".safetensors.index.json"))
        indexes.push_back(e.path().string());
      else if (ends_with(name, ".safetensors"))
        files.push_back(e.path().string());
      else if (ends_with(name, ".json") && name.find(".safetensors.index.") != std::string::npos)
        variants.push_back(name);  // save_pretrained(variant="fp16"): *.safetensors.index.fp16.json
    }
    LS_CHECK(!ec, "cannot list directory ", q(path), ": ", ec.message());
    std::sort(indexes.begin(), indexes.end());
    std::sort(files.begin(), files.end());
    std::sort(variants.begin(), variants.end());
    if (indexes.size() == 1) return read_index(named, indexes[0]);
    LS_CHECK(indexes.empty(), "directory ", q(path), " holds ", indexes.size(),
             " *.safetensors.index.json files; pass the one to use");
    if (!variants.empty()) {
      std::string list;
      for (const auto& v : variants) list += (list.empty() ? "" : ", ") + v;
      LS_FAIL("directory ", q(path), " holds the index of a variant (", list, ", written by "
              "save_pretrained(variant=...)) and no *.safetensors.index.json; pass the index to load (or one "
              ".safetensors file)");
    }
    LS_CHECK(!files.empty(), "directory ", q(path),
             " holds no .safetensors file and no *.safetensors.index.json");
    LS_CHECK(files.size() == 1, "directory ", q(path), " holds ", files.size(),
             " .safetensors files and no index json; pass one file or a *.safetensors.index.json");
    Checkpoint ck;
    ck.path = named;
    std::map<std::string, std::string> owner;
    add_file(ck, read_safetensors_header(files[0]), owner);
    return ck;
  }
  if (ends_with(path, ".json")) return read_index(named, path);
  Checkpoint ck;
  ck.path = named;
  std::map<std::string, std::string> owner;
  add_file(ck, read_safetensors_header(path), owner);
  return ck;
}

}  // namespace layerstream
