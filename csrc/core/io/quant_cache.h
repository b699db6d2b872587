// layerstream — the quantization cache file of the disk tier.
//
// With quantize= and a disk tier, a weight that stays in its checkpoint would
// be read dense from disk and packed again on every use. Instead, offload()
// packs such weights once into a cache file (cache_dir=) and the disk tier
// reads the packed bytes from it: fewer bytes from disk on every step, and no
// packing after the first run. docs/design/host-tier.md, "The quantization
// cache file", says why it looks as it does.
//
// The cache file is a .safetensors file (readable by any safetensors tool):
// one U8 tensor per weight, named as in its checkpoint, holding the packed
// layout of quant::layout_for(format, rows, cols) (docs/design/quant-formats.md);
// tensors back to back from a 4096-byte aligned data start. Its __metadata__
// says what it was built from: the cache version, the format, every source
// file (real path, size, modification time) and every item (tensor, file,
// offset, bytes, dtype, shape). A file whose metadata differs from what is
// asked now (a source rewritten, another format, another set of weights,
// another version) is stale and rebuilt; nothing is ever read from a stale
// one. One cache file per (format, set of source files): its name hashes
// them, so a changed set of weights rewrites the same file instead of
// leaving old ones behind.
//
// Building writes a temporary file in the same directory and renames it into
// place (atomic: a reader sees the old file or the complete new one, never a
// partial one); free space is checked first (statvfs), and any failure
// removes the temporary file and throws layerstream::Error naming the cache
// file, the tensor and what to change. While building it holds one weight
// dense and packed in RAM at a time.
//
// Thread safety: ensure() may run concurrently in several processes on the
// same directory (each writes its own temporary file; the last rename wins,
// with identical content). Ownership: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../quant.h"

namespace layerstream::quant_cache {

// Bumped whenever the packed bytes a format produces, or this file's layout,
// change: caches of another version are rebuilt.
constexpr int kVersion = 1;

// One weight to cache: its dense bytes in a checkpoint file.
struct Item {
  std::string tensor;            // its name in the checkpoint (unique within one call)
  std::string path;              // the checkpoint file
  uint64_t offset = 0, bytes = 0;  // where its dense bytes are there
  quant::SrcDtype dtype = quant::SrcDtype::F32;
  int64_t rows = 0, cols = 0;    // the weight as a matrix (quant::layout_for)
};

// Where one item's packed bytes lie in the cache file.
struct Placed {
  uint64_t offset = 0, bytes = 0;
};

struct Result {
  std::string path;          // the cache file
  bool built = false;        // written by this call (else found valid and reused)
  std::string reason;        // why it was built ("" when reused): missing, or what was stale
  std::vector<Placed> items;  // per item, in the order given
};

// Returns where the packed bytes of `items` (all in `format`) lie in their
// cache file under `dir` (created if missing), building the file first when it
// is missing or stale. `threads`: for packing (0 = one per hardware thread).
// Throws layerstream::Error when the directory cannot be written, a source
// cannot be read (or changed since it was opened), a weight cannot be packed
// (its shape, NaN/Inf), or there is no space for the file.
Result ensure(const std::string& dir, quant::Format format, const std::vector<Item>& items, int threads = 0);

// The cache file ensure() uses for these items under `dir`.
std::string path_for(const std::string& dir, quant::Format format, const std::vector<Item>& items);

}  // namespace layerstream::quant_cache
