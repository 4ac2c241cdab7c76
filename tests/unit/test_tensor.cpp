#include <gtest/gtest.h>

#include <cmath>

#include "q3vl/core/dtype.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/tensor/tensor.hpp"

using namespace q3vl;

TEST(Tensor, Bf16AndF16Conversions) {
  // bf16: round to nearest even on the 16 dropped bits.
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  float halfway = bf16_to_f32(0x3f80) + std::ldexp(1.0f, -8);  // exactly between 0x3f80 and 0x3f81
  EXPECT_EQ(f32_to_bf16(halfway), 0x3f80);                       // ties to even
  EXPECT_EQ(f32_to_bf16(std::nextafter(halfway, 2.f)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  // fp16 round trips every finite half value.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1f) == 0x1f) continue;  // inf/nan
    EXPECT_EQ(f32_to_f16(f16_to_f32(uint16_t(h))), h) << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f32_to_f16(65504.f), 0x7bff);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
}
