#include "q3vl/train/optim.hpp"

#include <algorithm>
#include <cmath>

namespace q3vl {

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWConfig& c, double lr,
                  double weight_decay, double gscale, int64_t t) {
  const double bc1 = 1.0 - std::pow(c.beta1, double(t)), bc2 = 1.0 - std::pow(c.beta2, double(t));
  const float b1 = float(c.beta1), b2 = float(c.beta2), gs = float(gscale);
  const float step = float(lr / bc1), sqrt_bc2 = float(std::sqrt(bc2)), eps = float(c.eps);
  const float decay = float(1.0 - lr * weight_decay);
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * gs;
    m[i] = b1 * m[i] + (1.f - b1) * gi;
    v[i] = b2 * v[i] + (1.f - b2) * gi * gi;
    p[i] = p[i] * decay - step * m[i] / (std::sqrt(v[i]) / sqrt_bc2 + eps);
  }
}

double Schedule::at(int64_t step) const {
  if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
  if (kind == "constant") return lr;
  const int64_t span = std::max<int64_t>(1, total - 1 - warmup);
  const double x = std::clamp(double(step - warmup) / double(span), 0.0, 1.0);
  const double f = kind == "linear" ? 1.0 - x : 0.5 * (1.0 + std::cos(M_PI * x));
  return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * f);
}

}  // namespace q3vl
