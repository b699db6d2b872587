// layerstream — a 64-bit checksum of bytes layerstream wrote to disk itself.
//
// The quantization cache file (quant_cache.h) records one per packed weight,
// and the disk tier checks it at the weight's first read in a process
// (stager.h, StagedPart::check): a cache file damaged or changed in place at
// the same size (which its metadata cannot see) is an error naming the file,
// never wrong weights. docs/design/host-tier.md, "The quantization cache
// file", says why at first read.
//
// Not cryptographic: it finds accidental changes (any change within one
// 8-byte word always; others with probability 1 - 2^-64 or so), at memory
// speed (four independent multiply-xor lanes over 8-byte words). The value is
// part of the cache file's format: changing it means bumping
// quant_cache::kVersion. Thread safety: a pure function.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace layerstream {

uint64_t checksum64(const void* data, uint64_t bytes);

// 16 lowercase hexadecimal digits (fixed width), and back; parse_checksum
// returns false for anything else.
std::string checksum_hex(uint64_t value);
bool parse_checksum(const std::string& hex, uint64_t* value);

// What a reader checks once: the checksum the bytes must have, and whether a
// read already found them so. Shared by the copies of one StagedPart.
struct ReadCheck {
  uint64_t expected = 0;
  std::atomic<bool> verified{false};
  explicit ReadCheck(uint64_t value) : expected(value) {}
};

}  // namespace layerstream
