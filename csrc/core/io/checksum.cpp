#include "checksum.h"

#include <cstdio>
#include <cstring>

namespace layerstream {

namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;  // odd: multiplying by it is a bijection
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;

inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// One word into a lane: a bijection of the lane for each word, so a change of
// one word always changes the lane.
inline uint64_t absorb(uint64_t lane, uint64_t word) { return rotl64((lane ^ word) * kPrime1, 29) * kPrime2; }

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // the cache file and its readers are little-endian (x86-64, aarch64)
  return v;
}

}  // namespace

uint64_t checksum64(const void* data, uint64_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {kPrime1, kPrime2, ~kPrime1, ~kPrime2};
  uint64_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int k = 0; k < 4; ++k) lane[k] = absorb(lane[k], load64(p + i + 8 * k));
  for (int k = 0; i + 8 <= bytes; i += 8, ++k) lane[k] = absorb(lane[k], load64(p + i));
  uint64_t tail = 0;
  std::memcpy(&tail, p + i, static_cast<size_t>(bytes - i));
  // Each lane enters through a bijection of the running value, then the tail
  // and the length (so that trailing zero bytes count).
  uint64_t h = bytes * kPrime2;
  for (uint64_t l : lane) h = absorb(h, l);
  h = absorb(h, tail);
  return h ^ (h >> 32);
}

std::string checksum_hex(uint64_t value) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(value));
  return hex;
}

bool parse_checksum(const std::string& hex, uint64_t* value) {
  if (hex.size() != 16) return false;
  uint64_t v = 0;
  for (char c : hex) {
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  *value = v;
  return true;
}

}  // namespace layerstream
