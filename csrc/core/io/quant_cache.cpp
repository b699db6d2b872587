#include "quant_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "core/align.h"
#include "core/error.h"
#include "core/json.h"
#include "core/planner.h"
#include "core/safetensors.h"
#include "checksum.h"
#include "source_file.h"

namespace layerstream::quant_cache {

namespace {

constexpr uint64_t kDataAlign = 4096;  // where the tensors start in the file
constexpr const char* kVersionKey = "layerstream.quant_cache";
// Per tensor, the checksum64 of its packed bytes: a JSON object of tensor name
// -> 16 hex digits (checked at each tensor's first read, checksum.h).
constexpr const char* kChecksumsKey = "checksums";

// The checksums' metadata value; `sums` null: placeholders of the same length
// (the header is written before the tensors are packed, and again after).
std::string checksums_value(const std::vector<Item>& items, const std::vector<uint64_t>* sums) {
  std::string out = "{";
  for (size_t i = 0; i < items.size(); ++i)
    out += std::string(i ? ", " : "") + json::quote(items[i].tensor) + ": \"" +
           (sums ? checksum_hex((*sums)[i]) : std::string(16, '0')) + "\"";
  return out + "}";
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  LS_CHECK(::realpath(path.c_str(), buf) != nullptr, path, ": cannot resolve the path: ", std::strerror(errno));
  return buf;
}

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// `dir` as an absolute path (from the working directory now): the cache file
// is opened again on every step, after the process may have changed it.
std::string absolute_dir(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || dir.front() == '/') return dir;
  char cwd[PATH_MAX];
  LS_CHECK(::getcwd(cwd, sizeof cwd) != nullptr, "cannot resolve cache_dir=", dir,
           " (the working directory): ", std::strerror(errno));
  return std::string(cwd) + "/" + dir;
}

std::string parent_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_stem(const std::string& path) {
  std::string name = path.substr(path.find_last_of('/') + 1);
  const std::string ext = ".safetensors";
  if (name.size() > ext.size() && name.compare(name.size() - ext.size(), ext.size(), ext) == 0)
    name.resize(name.size() - ext.size());
  return name;
}

// The metadata a valid cache for these items holds: the sources as they are
// now (real path, size, mtime) and the items as asked.
struct Expected {
  std::map<std::string, std::string> metadata;
  std::vector<std::string> real;  // per item, its source's real path
};

Expected expected(quant::Format format, const std::vector<Item>& items) {
  Expected e;
  std::map<std::string, std::string> real_of;
  std::string sources = "[", list = "[";
  for (const Item& it : items) {
    auto r = real_of.find(it.path);
    if (r == real_of.end()) {
      const std::string rp = real_path(it.path);
      struct stat st {};
      LS_CHECK(::stat(rp.c_str(), &st) == 0, it.path, ": cannot stat: ", std::strerror(errno));
      const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
      sources += std::string(sources.size() > 1 ? ", " : "") + "{\"path\": " + json::quote(rp) +
                 ", \"size\": " + std::to_string(st.st_size) + ", \"mtime_ns\": " + std::to_string(mtime) + "}";
      r = real_of.emplace(it.path, rp).first;
    }
    e.real.push_back(r->second);
    list += std::string(list.size() > 1 ? ", " : "") + "{\"tensor\": " + json::quote(it.tensor) +
            ", \"file\": " + json::quote(r->second) + ", \"offset\": " + std::to_string(it.offset) +
            ", \"bytes\": " + std::to_string(it.bytes) + ", \"dtype\": \"" + quant::to_string(it.dtype) +
            "\", \"shape\": [" + std::to_string(it.rows) + ", " + std::to_string(it.cols) + "]}";
  }
  e.metadata[kVersionKey] = std::to_string(kVersion);
  e.metadata["format"] = quant::to_string(format);
  e.metadata["sources"] = sources + "]";
  e.metadata["items"] = list + "]";
  return e;
}

// "" when `path` is a valid cache for `want` (and fills `placed`), else why not.
std::string stale(const std::string& path, const Expected& want, const std::vector<Item>& items,
                  const std::vector<uint64_t>& packed, std::vector<Placed>* placed, FileIdentity* identity) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "missing";
  SafetensorsHeader h;
  try {
    h = read_safetensors_header(path);
  } catch (const Error& e) {
    return std::string("unreadable (") + e.message() + ")";
  }
  for (const auto& [key, value] : want.metadata) {
    auto it = h.metadata.find(key);
    if (it == h.metadata.end() || it->second != value)
      return key == kVersionKey ? "another cache version"
             : key == "sources" ? "a source file changed (size or modification time) or moved"
             : key == "items"   ? "another set of weights"
                                : "another " + key;
  }
  std::map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : h.tensors) by_name[t.name] = &t;
  auto sums = h.metadata.find(kChecksumsKey);
  json::Value parsed;
  try {
    if (sums != h.metadata.end()) parsed = json::parse(sums->second, path + " (checksums)");
  } catch (const Error&) {
    return "its checksums are unreadable";
  }
  placed->clear();
  for (size_t i = 0; i < items.size(); ++i) {
    auto it = by_name.find(items[i].tensor);
    if (it == by_name.end() || it->second->nbytes != packed[i] || it->second->dtype != "U8")
      return "tensor '" + items[i].tensor + "' missing or of another size";
    const json::Value* sum = parsed.find(items[i].tensor);
    uint64_t value = 0;
    if (sum == nullptr || !sum->is_string() || !parse_checksum(sum->text, &value))
      return "no checksum for tensor '" + items[i].tensor + "'";
    placed->push_back({it->second->file_offset, it->second->nbytes, value});
  }
  *identity = h.identity;  // the file checked: readers check that it stays this one
  return "";
}

// Removes the temporaries of `cache_path` (<name>.tmp-<pid>[-<n>]) whose
// process is gone: a build killed before it could remove its own.
void remove_dead_temporaries(const std::string& cache_path) {
  const std::string dir = parent_of(cache_path);
  const std::string prefix = cache_path.substr(cache_path.find_last_of('/') + 1) + ".tmp-";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const char* digits = name.c_str() + prefix.size();
    char* end = nullptr;
    const long pid = std::strtol(digits, &end, 10);
    if (end == digits || pid <= 0 || (*end != '\0' && *end != '-') || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (EPERM: someone else's)
    ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(d);
}

// A file descriptor of a temporary file that is removed unless kept.
struct TempFile {
  std::string path;
  int fd = -1;
  bool keep = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!keep && !path.empty()) ::unlink(path.c_str());
  }
};

void write_all(TempFile& f, const void* data, uint64_t bytes, uint64_t at, const std::string& final_path,
               const std::string& what, uint64_t total) {
  const char* p = static_cast<const char*>(data);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(f.fd, p + done, static_cast<size_t>(std::min<uint64_t>(bytes - done, 64ull << 20)),
                               static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      LS_FAIL("writing the quantization cache file ", final_path, " failed at byte ", at + done, " of ",
              total, " (", what, "): ", std::strerror(err),
              err == ENOSPC || err == EDQUOT || err == EFBIG
                  ? ". Free space there, or pass another cache_dir= (a disk with room for the packed weights)"
                  : ". Check the directory, or pass another cache_dir=");
    }
    done += static_cast<uint64_t>(n);
  }
}

}  // namespace

std::string path_for(const std::string& dir, quant::Format format, const std::vector<Item>& items) {
  LS_CHECK(!items.empty(), "quant_cache: no weights to cache");
  std::vector<std::string> sources;
  uint64_t h = fnv1a(quant::to_string(format));
  // The set of weights (each by name, file, dtype and shape; not by where it
  // lies, so a rewritten checkpoint rewrites this file): a model with other
  // weights on disk gets its own file, never replacing one another uses.
  std::map<std::string, std::string> real_of;
  for (const Item& it : items) {
    auto r = real_of.find(it.path);
    if (r == real_of.end()) r = real_of.emplace(it.path, real_path(it.path)).first;
    sources.push_back(r->second);
    h = fnv1a(it.tensor + '\n' + r->second + '\n' + quant::to_string(it.dtype) + '\n' + std::to_string(it.rows) +
                  'x' + std::to_string(it.cols) + '\n',
              h);
  }
  std::sort(sources.begin(), sources.end());
  sources.erase(std::unique(sources.begin(), sources.end()), sources.end());
  for (const std::string& s : sources) h = fnv1a(s + '\n', h);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return absolute_dir(dir) + "/" + base_stem(sources.front()) + "." + quant::to_string(format) + "." + hex +
         ".safetensors";
}

Result ensure(const std::string& cache_dir, quant::Format format, const std::vector<Item>& items, int threads) {
  LS_CHECK(format != quant::Format::None && !quant::is_gguf(format), "quant_cache: format ",
           quant::to_string(format), " is not one offload() packs");
  {
    std::map<std::string, int> seen;
    for (const Item& it : items)
      LS_CHECK(seen[it.tensor]++ == 0, "quant_cache: tensor '", it.tensor, "' named twice");
  }
  // The sources must be the files whose headers were read (a checkpoint
  // changed since loading is an error, even when a cache of the new one exists).
  std::map<std::string, std::shared_ptr<SourceFile>> open;
  for (const Item& it : items) {
    if (!it.identity.recorded() || open.count(it.path)) continue;
    auto f = SourceFile::open(it.path, it.identity);
    f->check(it.tensor);
    open[it.path] = f;
  }
  const std::string dir = absolute_dir(cache_dir);
  Result r;
  r.path = path_for(dir, format, items);
  const Expected want = expected(format, items);
  // Not beside a checkpoint: load_safetensors() of that directory would find
  // the cache file as a second .safetensors file there and refuse it.
  char real_dir[PATH_MAX];
  if (::realpath(dir.c_str(), real_dir) != nullptr) {
    for (const std::string& src : want.real)
      LS_CHECK(parent_of(src) != real_dir, "cache_dir=", cache_dir, " is the directory of the checkpoint ", src,
               ": a cache file there would make load_safetensors() of that directory find two .safetensors files. "
               "Pass a directory of its own, e.g. cache_dir=", dir, "/layerstream-cache");
  }
  std::vector<uint64_t> packed;
  for (const Item& it : items) {
    packed.push_back(quant::layout_for(format, it.rows, it.cols).total_bytes());
    const uint64_t elem = it.dtype == quant::SrcDtype::F32 ? 4 : 2;
    LS_CHECK(it.bytes == static_cast<uint64_t>(it.rows) * static_cast<uint64_t>(it.cols) * elem, it.path,
             ": tensor '", it.tensor, "' has ", it.bytes, " bytes; [", it.rows, ", ", it.cols, "] of ",
             quant::to_string(it.dtype), " needs ", static_cast<uint64_t>(it.rows) * it.cols * elem);
  }
  r.reason = stale(r.path, want, items, packed, &r.items, &r.identity);
  if (r.reason.empty()) return r;
  r.built = true;
  remove_dead_temporaries(r.path);

  // The directory, and room for the file.
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    LS_FAIL("cannot create the cache directory ", dir, " (cache_dir=): ", std::strerror(errno));
  std::string header = "{\"__metadata__\": {";
  bool first = true;
  for (const auto& [key, value] : want.metadata) {
    header += std::string(first ? "" : ", ") + json::quote(key) + ": " + json::quote(value);
    first = false;
  }
  // Written last: the header is rewritten with the real values once every
  // tensor is packed (the same length: fixed-width hex digits).
  const std::string placeholder_sums = json::quote(checksums_value(items, nullptr));
  const size_t sums_at = header.size() + json::quote(kChecksumsKey).size() + 4;
  header += ", " + json::quote(kChecksumsKey) + ": " + placeholder_sums + "}";
  uint64_t data_bytes = 0;
  std::vector<uint64_t> begin;
  for (size_t i = 0; i < items.size(); ++i) {
    begin.push_back(data_bytes);
    header += ", " + json::quote(items[i].tensor) + ": {\"dtype\": \"U8\", \"shape\": [" + std::to_string(packed[i]) +
              "], \"data_offsets\": [" + std::to_string(data_bytes) + ", " + std::to_string(data_bytes + packed[i]) +
              "]}";
    data_bytes += packed[i];
  }
  header += "}";
  // Trailing spaces (allowed in the header) align the data start.
  const uint64_t data_start = round_up(8 + header.size(), kDataAlign);
  header.append(static_cast<size_t>(data_start - 8 - header.size()), ' ');
  const uint64_t total = data_start + data_bytes;
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    LS_CHECK(free_bytes >= total, "no space for the quantization cache file ", r.path, ": it needs ",
             format_bytes(total), " and ", dir, " has ", format_bytes(free_bytes),
             " free. Free space there, or pass another cache_dir= (a disk with room for the packed weights)");
  }

  static std::atomic<uint64_t> serial{0};  // threads of one process build their own temporaries
  TempFile tmp;
  tmp.path = r.path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  tmp.fd = ::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LS_CHECK(tmp.fd >= 0, "cannot write the quantization cache file in ", dir, " (cache_dir=): ", std::strerror(errno));
  const uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  write_all(tmp, len, 8, 0, r.path, "header", total);
  write_all(tmp, header.data(), n, 8, r.path, "header", total);

  // One weight at a time: read it dense (checked: the source is the one
  // described in the metadata), pack it, write it.
  std::vector<char> dense, out;
  std::vector<uint64_t> sums;
  r.items.clear();
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    auto& f = open[it.path];
    if (!f) f = SourceFile::open(it.path, it.identity);
    dense.resize(static_cast<size_t>(it.bytes));
    out.assign(static_cast<size_t>(packed[i]), 0);
    f->read(dense.data(), it.offset, it.bytes, it.tensor, &SourceFile::readers());
    try {
      quant::pack(format, dense.data(), it.dtype, it.rows, it.cols, out.data(), threads);
    } catch (const Error& e) {
      LS_FAIL("cannot quantize '", it.tensor, "' of ", it.path, " to ", quant::to_string(format), ": ", e.message());
    }
    write_all(tmp, out.data(), packed[i], data_start + begin[i], r.path, "tensor '" + it.tensor + "'", total);
    sums.push_back(checksum64(out.data(), packed[i]));
    r.items.push_back({data_start + begin[i], packed[i], sums.back()});
  }
  const std::string real_sums = json::quote(checksums_value(items, &sums));
  LS_INTERNAL_CHECK(real_sums.size() == placeholder_sums.size() &&
                        header.compare(sums_at, placeholder_sums.size(), placeholder_sums) == 0,
                    "quant_cache: the checksums do not fit their placeholder");
  write_all(tmp, real_sums.data(), real_sums.size(), 8 + sums_at, r.path, "checksums", total);
  // The sources must not have changed while they were read.
  LS_CHECK(expected(format, items).metadata == want.metadata, "a checkpoint file changed while the quantization "
           "cache file ", r.path, " was built from it; run again when it no longer changes");
  LS_CHECK(::fsync(tmp.fd) == 0, "writing the quantization cache file ", r.path, " failed: ", std::strerror(errno),
           ". Free space there, or pass another cache_dir=");
  r.identity = FileIdentity::of(tmp.fd, tmp.path);  // link() and rename() keep it
  // Published without replacing a valid file another reader may use: link()
  // fails when the name exists (the temporary is then removed).
  if (::link(tmp.path.c_str(), r.path.c_str()) == 0) return r;
  const int err = errno;
  if (err == EEXIST) {
    // Built meanwhile by another process (or thread): use it when valid.
    Result theirs = r;
    theirs.built = false;
    theirs.reason = stale(r.path, want, items, packed, &theirs.items, &theirs.identity);
    if (theirs.reason.empty()) return theirs;
  }
  // A stale file (or a file system without hard links): replaced atomically.
  LS_CHECK(::rename(tmp.path.c_str(), r.path.c_str()) == 0, "cannot put the quantization cache file in place (",
           r.path, "): ", std::strerror(errno));
  tmp.keep = true;
  return r;
}

}  // namespace layerstream::quant_cache
