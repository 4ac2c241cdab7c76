// The tests' comparisons (tests/compare.hpp) fail on NaN and Inf on either side, where std::max over |a - b| read
// NaN as error 0: planted NaN and Inf give +inf errors, which fail every bound.
#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <vector>

#include "../compare.hpp"

using namespace q3vl;

TEST(Compare, NanAndInfOnEitherSideFail) {
  const std::vector<float> ref{1.f, -2.f, 0.5f, 4.f};
  // What the old helpers did: std::max keeps the running maximum when the new value is NaN.
  double old = 0;
  for (float v : {NAN, NAN, NAN, NAN}) old = std::max(old, double(std::fabs(v - 1.f)));
  EXPECT_EQ(old, 0.0);
  for (const float bad : {NAN, INFINITY, -INFINITY})
    for (size_t at : {size_t(0), size_t(3)}) {
      std::vector<float> got = ref, want = ref;
      got[at] = bad;
      want[at] = bad;
      for (const auto& [a, b] : {std::pair{got, ref}, std::pair{ref, want}, std::pair{got, want}}) {
        EXPECT_EQ(test::max_diff(a, b), test::kNonFinite) << bad << " at " << at;
        EXPECT_EQ(test::rel_max_diff(a, b), test::kNonFinite) << bad << " at " << at;
        EXPECT_EQ(test::rel_norm_diff(a, b), test::kNonFinite) << bad << " at " << at;
        EXPECT_EQ(test::failures_of([&] { EXPECT_LE(test::rel_max_diff(a, b), 1e-3); }).size(), 1u);
      }
      EXPECT_EQ(test::max_abs(got), test::kNonFinite);
    }
  const std::vector<float> all_nan(4, NAN);
  EXPECT_EQ(test::rel_max_diff(all_nan, ref), test::kNonFinite);
  EXPECT_EQ(test::rel_max_diff(all_nan, all_nan), test::kNonFinite);
  EXPECT_EQ(test::worse(0.0, NAN), test::kNonFinite);
  EXPECT_EQ(test::worse(NAN, 1.0), test::kNonFinite);
  EXPECT_EQ(test::max_diff(ref, std::vector<float>(3, 1.f)), test::kNonFinite) << "sizes differ";
}

TEST(Compare, FiniteErrors) {
  const std::vector<double> want{1, -2, 0.5, 4}, got{1, -2.5, 0.5, 4.1};
  EXPECT_DOUBLE_EQ(test::max_diff(got, want), 0.5);
  EXPECT_DOUBLE_EQ(test::max_abs(want), 4);
  EXPECT_DOUBLE_EQ(test::rel_max_diff(got, want), 0.125);
  EXPECT_DOUBLE_EQ(test::rel_norm_diff(got, want), std::sqrt((0.25 + 0.01) / (1 + 4 + 0.25 + 16)));
  EXPECT_EQ(test::rel_max_diff(want, want), 0.0);
  const std::vector<double> zero(4, 0.0);
  EXPECT_EQ(test::rel_norm_diff(zero, zero), 0.0);
  EXPECT_EQ(test::rel_norm_diff(got, zero), test::kNonFinite) << "a non-zero difference to a zero reference";
  EXPECT_DOUBLE_EQ(test::max_diff(std::span(got).subspan(1, 2), std::span(want).subspan(1, 2)), 0.5);
  // Rows 0 and 2 of a [3, 2] array; an empty mask keeps every row.
  const std::vector<float> rows{1, 2, 3, 4, 5, 6};
  EXPECT_EQ(test::masked_rows(rows, std::vector<int64_t>{1, 0, 1}, 2), (std::vector<float>{1, 2, 5, 6}));
  EXPECT_EQ(test::masked_rows(rows, std::vector<int64_t>{}, 2), rows);
}
