// Element types shared by tensors and communicators, and the bf16/fp16 <-> fp32 conversions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace q3vl {

enum class DType { BF16, F16, F32, F64, I32, I64, U8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even, as PyTorch does; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// Array forms (bf16 parameter gathers).
inline void f32_to_bf16(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = f32_to_bf16(x[i]);
}
inline void bf16_to_f32(const uint16_t* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(x[i]);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace q3vl
