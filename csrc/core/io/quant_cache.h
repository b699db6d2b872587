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
// offset, bytes, dtype, shape), and holds each tensor's checksum (checksum.h),
// which the disk tier checks at the tensor's first read (the metadata cannot
// see bytes changed in place). A file whose metadata differs from what is
// asked now (a source rewritten, another format, another set of weights,
// another version) is stale and rebuilt; nothing is ever read from a stale
// one. One cache file per (format, source files, set of weights): its name
// hashes them (each weight by name, dtype and shape), so two models over one
// checkpoint with other weights on disk get two files, and a rewritten
// checkpoint rewrites the same file instead of leaving old ones behind.
//
// Building writes a temporary file (<name>.tmp-<pid>-<n>) in the same
// directory and publishes it without replacing a valid file: link() to the
// cache name, then the temporary is removed; when the name exists already
// (another process built it meanwhile) that file is checked and used when
// valid, and only a stale one is replaced (rename). A reader never sees a
// partial file, and a valid cache file is never replaced under one.
// Temporaries of the same name left by processes that are gone (killed while
// building) are removed. Free space is checked first (statvfs), and any
// failure removes the temporary file and throws layerstream::Error naming the
// cache file, the tensor and what to change. While building it holds one
// weight dense and packed in RAM at a time.
//
// Thread safety: ensure() may run concurrently in several processes (and
// threads) on the same directory: each writes its own temporary file, the
// first to publish wins and the others use its file. Ownership: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../quant.h"
#include "source_file.h"  // FileIdentity

namespace layerstream::quant_cache {

// Bumped whenever the packed bytes a format produces, or this file's layout,
// change: caches of another version are rebuilt.
constexpr int kVersion = 2;  // 2: per-tensor checksums

// One weight to cache: its dense bytes in a checkpoint file.
struct Item {
  std::string tensor;            // its name in the checkpoint (unique within one call)
  std::string path;              // the checkpoint file
  uint64_t offset = 0, bytes = 0;  // where its dense bytes are there
  quant::SrcDtype dtype = quant::SrcDtype::F32;
  int64_t rows = 0, cols = 0;    // the weight as a matrix (quant::layout_for)
  FileIdentity identity;         // `path` as its header was read, when recorded: checked first
};

// Where one item's packed bytes lie in the cache file.
struct Placed {
  uint64_t offset = 0, bytes = 0;
  uint64_t checksum = 0;  // checksum64 of the packed bytes, as written (checksum.h)
};

struct Result {
  std::string path;          // the cache file
  bool built = false;        // written by this call (else found valid and reused)
  std::string reason;        // why it was built ("" when reused): missing, or what was stale
  std::vector<Placed> items;  // per item, in the order given
  FileIdentity identity;      // the cache file as checked or written (readers check it)
};

// Returns where the packed bytes of `items` (all in `format`) lie in their
// cache file under `dir` (created if missing), building the file first when it
// is missing or stale. `dir` relative is taken from the working directory now;
// it must not be the directory of a source (see ensure()'s message).
// `threads`: for packing (0 = one per hardware thread). Throws
// layerstream::Error when the directory cannot be written, a source cannot be
// read (or changed since its identity was recorded or it was opened), a
// weight cannot be packed (its shape, NaN/Inf), or there is no space for the file.
Result ensure(const std::string& dir, quant::Format format, const std::vector<Item>& items, int threads = 0);

// The cache file ensure() uses for these items under `dir`.
std::string path_for(const std::string& dir, quant::Format format, const std::vector<Item>& items);

}  // namespace layerstream::quant_cache
