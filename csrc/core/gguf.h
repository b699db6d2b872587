// layerstream — GGUF file reader (torch-free).
//
// A .gguf file (llama.cpp / ggml; also used for diffusion models) is, all
// little-endian: magic "GGUF", version (uint32; 2 and 3 are read), tensor
// count and key/value count (uint64), the key/value metadata (typed values,
// strings, arrays), one info record per tensor (name, dims innermost first,
// ggml type, offset into the data section), padding to the file's alignment
// (metadata key general.alignment, default 32), then the data section.
//
// read_gguf reads ONLY the header (never the tensor data) and validates it
// completely; every problem is one layerstream::Error line naming the file
// (and tensor): bad magic or version, a string or array longer than the
// file, an unknown value type, an unknown ggml type, dims whose element
// count is not whole blocks, tensor data past the end of the file or
// overlapping another tensor, an offset that is not aligned.
//
// Thread safety: free functions over values; no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "quant.h"

namespace layerstream {

struct GgmlType {
  const char* name = nullptr;  // "F32", "Q4_K", ...; nullptr: unknown id
  uint32_t block_elems = 0;    // 1 for plain element types
  uint32_t block_bytes = 0;
};
// The ggml tensor type with this id (as in ggml.h / gguf-py's GGMLQuantizationType).
GgmlType ggml_type(uint32_t id);
// The id of the ggml type named `name` ("Q4_K", "F16", ...; case-sensitive),
// false when no type has that name.
bool ggml_type_by_name(std::string_view name, uint32_t& id);
// The layerstream format that streams a tensor of this ggml type as it is
// (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K); Format::None otherwise (plain
// element types such as F16, and the block types layerstream cannot dequantize).
quant::Format ggml_type_format(uint32_t id);
// Why tensor `tensor` of `path`, of ggml type `type_name`, cannot be read
// (neither a plain element type nor one ggml_type_format streams), with the
// types that can and what to do; the planner's and load_gguf()'s refusal
// (Python: _C.gguf_type_unreadable).
std::string gguf_type_unreadable(const std::string& path, const std::string& tensor, const std::string& type_name);

struct GgufTensor {
  std::string name;
  std::vector<uint64_t> shape;  // torch order: outermost first (the file's dims reversed)
  uint32_t type = 0;            // ggml type id
  std::string type_name;        // "Q4_K", ...
  uint64_t offset = 0;          // absolute byte offset of the data in the file
  uint64_t nbytes = 0;          // numel / block_elems * block_bytes
  uint64_t numel = 0;
};

struct GgufFile {
  std::string path;
  uint32_t version = 0;
  uint64_t file_bytes = 0;
  uint64_t alignment = 32;
  uint64_t data_offset = 0;  // start of the data section
  std::vector<GgufTensor> tensors;  // in file order
  // Scalar metadata as text (numbers in decimal, bools "true"/"false",
  // strings as they are); arrays as "[N x TYPE]" except arrays of at most 16
  // scalars, which are listed: "[1, 2, 3]".
  std::map<std::string, std::string> metadata;
};

// Reads and validates the header of one .gguf file.
GgufFile read_gguf(const std::string& path);

// The same on an in-memory image of the file's first bytes (at least the
// header; `file_bytes` is the size of the whole file). `what` names the file
// in messages.
GgufFile parse_gguf(std::string_view bytes, uint64_t file_bytes, const std::string& what);

}  // namespace layerstream
