// Element types shared by tensors and communicators, and the bf16/fp16 <-> fp32 conversions.
#pragma once
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace q3vl {

enum class DType { BF16, F16, F32, F64, I32, I64, U8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

// Weight-only 8-bit storage of serving's linears (model.weight_dtype): one byte a weight and one fp32 scale per output
// channel, W ~= q * scale[row]. Int8: integers in [-127, 127]; Fp8: OCP FP8 E4M3 (CUDA's __nv_fp8_e4m3: 4 exponent
// bits, 3 mantissa bits, max finite 448, no infinities), the per-channel fp8 weights vLLM serves. None: no quantization.
enum class QFormat : uint8_t { None, Int8, Fp8 };
const char* qformat_name(QFormat f);  // "fp32" (None), "int8", "fp8": the values of model.weight_dtype

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

// FP8 E4M3, bit-exact with CUDA's __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3): round to nearest even,
// beyond 464 (448 and half a step) and infinities saturate to +-448, NaN (either sign) gives 0x7f.
uint8_t f32_to_fp8_e4m3(float f);
// And back (exact: every E4M3 value is a float); 0x7f and 0xff are NaN. Branch-light and constexpr, for the table.
constexpr float fp8_e4m3_to_f32(uint8_t b) {
  const uint32_t s = uint32_t(b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
  if ((b & 0x7fu) == 0x7fu) return std::bit_cast<float>(s | 0x7fc00000u);
  if (e) return std::bit_cast<float>(s | (e + 120u) << 23 | m << 20);  // (1 + m/8) 2^(e-7)
  const float v = float(m) * 0x1p-9f;                                  // subnormal: m 2^-9
  return s ? -v : v;
}
// All 256 codes decoded (the CPU products widen weights through it).
inline constexpr std::array<float, 256> kFp8E4M3 = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[size_t(b)] = fp8_e4m3_to_f32(uint8_t(b));
  return t;
}();

// 16-bit float storage as distinct types, so that a template picks the widening (weights stored in bf16 or fp16 for
// inference, ops::linear_lowp_fwd).
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};
struct Fp8E4M3 {  // model.weight_dtype = "fp8": one byte a weight, with its row's scale
  uint8_t bits;
};
inline float widen(int8_t q) { return float(q); }
inline float widen(Fp8E4M3 q) { return kFp8E4M3[q.bits]; }
inline float widen(Bf16 h) { return bf16_to_f32(h.bits); }
inline float widen(Fp16 h) { return f16_to_f32(h.bits); }

}  // namespace q3vl
