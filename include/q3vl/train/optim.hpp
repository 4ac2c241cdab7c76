// AdamW on fp32 shards and the learning-rate schedule.
#pragma once
#include <cstdint>
#include <string>

namespace q3vl {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// One AdamW update of n elements (PyTorch semantics, decoupled weight decay p *= 1 - lr*wd before the Adam step;
// `t` counts applied updates from 1). `gscale` multiplies the gradient first (clipping).
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWConfig& c, double lr,
                  double weight_decay, double gscale, int64_t t);

struct Schedule {
  std::string kind = "cosine";  // cosine | linear | constant
  double lr = 1e-4, min_lr_ratio = 0.0;
  int64_t warmup = 0, total = 1;
  // Learning rate of optimizer step `step` (0-based): linear warmup from lr/warmup to lr, then decay to
  // lr*min_lr_ratio at step total-1.
  double at(int64_t step) const;
};

}  // namespace q3vl
