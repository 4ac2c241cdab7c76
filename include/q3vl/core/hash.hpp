// Counter-based random draws: pure functions of their inputs, the same on every rank, platform and rank count
// (weight init by tensor name and element, LoRA dropout masks redrawn in backward).
#pragma once
#include <cstdint>

namespace q3vl {

// splitmix64's step: a well-mixed 64-bit hash of x.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace q3vl
