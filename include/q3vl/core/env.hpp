// Environment knobs for A/B runs on the GPU machine (Q3VL_HEAD_ROWS, Q3VL_NORM_CHUNK_ROWS, Q3VL_ROUTE_CLUSTER,
// Q3VL_PDL): each caller reads its knob once, into a function-local static.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace q3vl {

// The value of `name` where it is set to an integer > 0, else `fallback`.
inline int64_t env_positive(const char* name, int64_t fallback) {
  const char* e = std::getenv(name);
  const long long v = e ? std::atoll(e) : 0;
  return v > 0 ? int64_t(v) : fallback;
}

// Whether `name` is set to exactly `value`.
inline bool env_is(const char* name, std::string_view value) {
  const char* e = std::getenv(name);
  return e && value == e;
}

}  // namespace q3vl
