#include "q3vl/train/optim.hpp"

#include <algorithm>
#include <cmath>

namespace q3vl {

double Schedule::at(int64_t step) const {
  if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
  if (kind == "constant") return lr;
  const int64_t span = std::max<int64_t>(1, total - 1 - warmup);
  const double x = std::clamp(double(step - warmup) / double(span), 0.0, 1.0);
  const double f = kind == "linear" ? 1.0 - x : 0.5 * (1.0 + std::cos(M_PI * x));
  return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * f);
}

}  // namespace q3vl
