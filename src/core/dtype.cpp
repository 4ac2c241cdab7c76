#include "q3vl/core/dtype.hpp"

#include <cmath>

namespace q3vl {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::BF16: case DType::F16: return 2;
    case DType::F32: case DType::I32: return 4;
    case DType::F64: case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    case DType::F32: return "fp32";
    case DType::F64: return "fp64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
  }
  return "?";
}

const char* qformat_name(QFormat f) {
  switch (f) {
    case QFormat::None: return "fp32";
    case QFormat::Int8: return "int8";
    case QFormat::Fp8: return "fp8";
  }
  return "?";
}

uint8_t f32_to_fp8_e4m3(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return 0x7f;         // NaN: CUDA's canonical one, whatever the sign
  if (x > 0x43e80000u) return sign | 0x7e;  // beyond 464 (infinity too): saturated to 448
  if (x < 0x3c800000u) {                    // below 2^-6, the smallest normal: steps of 2^-9
    // Scaling by 2^9 is exact; nearbyint rounds half to even (8 is 2^-6, the smallest normal's code).
    return sign | static_cast<uint8_t>(std::nearbyint(std::fabs(f) * 512.0f));
  }
  uint32_t q = (((x >> 23) - 120u) << 3) | ((x >> 20) & 7u);  // exponent rebiased from 127 to 7, 3 mantissa bits
  const uint32_t rem = x & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ++q;  // a carry into the exponent is correct; 464 stays 448
  return sign | static_cast<uint8_t>(q);
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (x >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to inf
  if (x < 0x38800000u) {                       // below the smallest normal half: subnormal or zero
    // Scaling by 2^24 is exact; nearbyint rounds half to even in the default rounding mode.
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
  }
  uint32_t h = (x >> 13) - (112u << 10);
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry into the exponent is correct
  return sign | static_cast<uint16_t>(h);
}

}  // namespace q3vl
