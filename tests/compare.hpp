// Comparisons of numeric results that fail on NaN and Inf. std::max(worst, |a - b|) keeps worst when |a - b| is NaN,
// so a max over plain differences reads an all-NaN output as error 0, and `err <= tol` is false for NaN only when the
// NaN reaches it. Here every non-finite element, on either side, makes the error +inf: it survives every max and sum,
// fails every bound, and prints as inf. test_compare.cpp plants NaN and Inf and expects the failures.
#pragma once
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace q3vl::test {

constexpr double kNonFinite = std::numeric_limits<double>::infinity();

// |a - b|, or +inf when either is NaN or infinite.
inline double abs_diff(double a, double b) {
  return std::isfinite(a) && std::isfinite(b) ? std::fabs(a - b) : kNonFinite;
}

// max(w, e) that no NaN escapes: the worst of several errors.
inline double worse(double w, double e) { return std::isnan(w) || std::isnan(e) ? kNonFinite : std::max(w, e); }

// max |a[i]|; +inf when an element is not finite. A: anything with size() and operator[] (vector, span).
template <class A>
double max_abs(const A& a) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, abs_diff(double(a[i]), 0.0));
  return m;
}

// max |a[i] - b[i]|; +inf when an element of either is not finite, or the sizes differ.
template <class A, class B>
double max_diff(const A& a, const B& b) {
  if (a.size() != b.size()) return kNonFinite;
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, abs_diff(double(a[i]), double(b[i])));
  return d;
}

// max |got - want| / max |want|, the error normalised by the reference's largest magnitude; +inf as max_diff.
template <class A, class B>
double rel_max_diff(const A& got, const B& want) {
  const double d = max_diff(got, want);
  return d == 0 || d == kNonFinite ? d : d / std::max(max_abs(want), 1e-30);
}

// ||got - want|| / ||want|| (2-norms; 0 when both are zero, +inf for a non-zero difference to a zero reference);
// +inf as max_diff.
template <class A, class B>
double rel_norm_diff(const A& got, const B& want) {
  if (got.size() != want.size()) return kNonFinite;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = abs_diff(double(got[i]), double(want[i]));
    if (d == kNonFinite) return kNonFinite;
    num += d * d, den += double(want[i]) * double(want[i]);
  }
  return num == 0 ? 0 : den == 0 ? kNonFinite : std::sqrt(num / den);
}

// The rows of a [n, width] array whose mask entry is non-zero: a batch's real (unpadded) positions (an empty mask,
// as Batch::attention_mask may be: every row).
template <class T, class M>
std::vector<T> masked_rows(const std::vector<T>& a, const M& mask, int64_t width) {
  if (mask.empty()) return a;
  std::vector<T> out;
  for (size_t p = 0; p < mask.size() && int64_t(p + 1) * width <= int64_t(a.size()); ++p)
    if (mask[p]) out.insert(out.end(), a.begin() + int64_t(p) * width, a.begin() + int64_t(p + 1) * width);
  return out;
}

// The messages of the GoogleTest failures that fn reports, intercepted (they do not fail the calling test): for tests
// of a check, which plant a fault and expect the check to fail.
inline std::vector<std::string> failures_of(const std::function<void()>& fn) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter catcher(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    fn();
  }
  std::vector<std::string> out;
  for (int i = 0; i < results.size(); ++i)
    if (results.GetTestPartResult(i).failed()) out.push_back(results.GetTestPartResult(i).message());
  return out;
}

}  // namespace q3vl::test
