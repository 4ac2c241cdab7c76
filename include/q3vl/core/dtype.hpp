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
// Exact for every half (subnormals, infinities, NaN payloads): the magnitude's bits shifted into place make a float
// 2^-112 times the value, and scaling by 2^112 is exact; the all-ones exponent is restored after. Branch-free, so the
// widening loops of ops::linear_lowp_fwd vectorize.
inline float f16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h & 0x7fffu) << 13;
  float f;
  std::memcpy(&f, &u, 4);
  f *= 0x1p112f;
  std::memcpy(&u, &f, 4);
  if ((h & 0x7c00u) == 0x7c00u) u |= 0x7f800000u;  // infinity or NaN
  u |= uint32_t(h & 0x8000u) << 16;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even; beyond fp16's range (|f| >= 65520) gives infinity.
uint16_t f32_to_f16(float f);

// 16-bit float storage as distinct types, so that a template picks the widening (weights stored in bf16 or fp16 for
// inference, ops::linear_lowp_fwd).
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};
inline float widen(int8_t q) { return float(q); }
inline float widen(Bf16 h) { return bf16_to_f32(h.bits); }
inline float widen(Fp16 h) { return f16_to_f32(h.bits); }

}  // namespace q3vl
