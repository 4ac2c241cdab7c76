// Counter-based random draws: pure functions of their inputs, the same on every rank, platform and rank count
// (weight init by tensor name and element, LoRA dropout masks redrawn in backward).
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define Q3VL_HOST_DEVICE __host__ __device__
#else
#define Q3VL_HOST_DEVICE
#endif

namespace q3vl {

// splitmix64's step: a well-mixed 64-bit hash of x.
Q3VL_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Dropout's draw for element i under `key` (LoRA's masks, dev::dropout_*): dropped when a uniform double from the
// top 53 bits of the hash is below p. Host and device draw the same mask.
Q3VL_HOST_DEVICE inline bool dropout_drops(uint64_t key, int64_t i, double p) {
  return double(splitmix64(key ^ splitmix64(uint64_t(i))) >> 11) * 0x1p-53 < p;
}

}  // namespace q3vl
