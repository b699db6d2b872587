// layerstream — safetensors header reader (torch-free).
//
// A .safetensors file is: 8 bytes little-endian header length N, N bytes of
// JSON header, then the data buffer. The header maps tensor names to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
// data buffer) plus an optional "__metadata__" string->string map.
//
// read_safetensors_header reads ONLY the length and the header (never the
// weights) and validates it completely; every problem is one
// layerstream::Error line naming the file (and tensor): header length larger
// than the file or than kMaxHeaderBytes, bad JSON, unknown dtype, a shape
// whose size does not match the offsets, offsets past the end of the file,
// overlapping tensors, ... Gaps between tensors are tolerated.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "io/source_file.h"  // FileIdentity

namespace layerstream {

// Headers larger than this are rejected as absurd (the format allows up to
// 100 MB too).
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

// Element width in bits of a safetensors dtype name ("F32" -> 32, "F4" -> 4);
// 0 when the name is unknown.
unsigned safetensors_dtype_bits(std::string_view dtype);
// True for floating-point dtypes of at least 16 bits (F16, BF16, F32, F64),
// i.e. those --quantize can pack.
bool safetensors_dtype_is_wide_float(std::string_view dtype);
// The known dtype names, comma-separated (for error messages).
std::string safetensors_known_dtypes();

struct TensorInfo {
  std::string name;
  std::string dtype;            // as in the header, e.g. "BF16"
  std::vector<uint64_t> shape;  // empty = scalar
  uint64_t begin = 0;           // data_offsets[0], relative to the data buffer
  uint64_t end = 0;             // data_offsets[1]
  uint64_t numel = 0;
  uint64_t nbytes = 0;          // == end - begin == numel * bits / 8
  std::string file;             // the .safetensors file holding it
  uint64_t file_offset = 0;     // where its bytes start in `file` (8 + N + begin)
  FileIdentity identity;        // `file` as its header was read (not recorded by parse_safetensors_header)
};

struct SafetensorsHeader {
  std::string path;
  uint64_t file_bytes = 0;
  uint64_t header_bytes = 0;      // N
  uint64_t data_offset = 0;       // 8 + N: where the data buffer starts
  std::vector<TensorInfo> tensors;  // in header order
  std::map<std::string, std::string> metadata;
  FileIdentity identity;  // the file as its header was read (read_safetensors_header)
};

// Reads and validates the header of one .safetensors file, recording the
// file's identity (every later read of its tensors checks it).
SafetensorsHeader read_safetensors_header(const std::string& path);

// The same validation on an in-memory file image (`bytes` must hold at least
// the first 8 + N bytes; `file_bytes` is the size of the whole file).
// `what` names the file in messages. Used by the file reader and the fuzzer.
SafetensorsHeader parse_safetensors_header(std::string_view bytes, uint64_t file_bytes,
                                           const std::string& what);

// A checkpoint: one .safetensors file, or several shards listed by a
// *.safetensors.index.json.
struct Checkpoint {
  std::string path;                  // what the user named
  std::string index_path;            // the index json, if any
  std::vector<std::string> files;    // the .safetensors files, in first-use order
  std::vector<TensorInfo> tensors;   // all tensors of all files (file order, then header order)
  std::map<std::string, std::string> metadata;  // merged __metadata__ of the files
  uint64_t total_bytes() const;      // sum of tensor nbytes
};

// `path` is a .safetensors file, a *.safetensors.index.json (its weight_map
// names shard files relative to the index), or a directory holding exactly
// one index json or exactly one .safetensors file. A diffusers pipeline's
// root (model_index.json) and a directory whose only index is a variant's
// (*.safetensors.index.fp16.json) are errors saying what to pass instead.
Checkpoint read_checkpoint(const std::string& path);

}  // namespace layerstream
