// Finite-difference helpers shared by the op and model tests (double precision, central differences).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace q3vl::test {

inline std::vector<double> randn(size_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Checks analytic[i] against (f(x+h e_i) - f(x-h e_i)) / 2h for the listed indices (all when empty).
inline void expect_grad(const char* what, std::vector<double>& x, const std::vector<double>& analytic,
                        const std::function<double()>& f, std::vector<size_t> which = {}, double tol = 1e-6,
                        double h = 1e-5) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  if (which.empty())
    for (size_t i = 0; i < x.size(); ++i) which.push_back(i);
  for (size_t i : which) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f();
    x[i] = x0 - h;
    const double fm = f();
    x[i] = x0;
    const double num = (fp - fm) / (2 * h);
    EXPECT_NEAR(analytic[i], num, tol * (1 + std::fabs(num))) << what << " index " << i;
  }
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace q3vl::test
