// AdamW hyperparameters (the update itself is dev::adamw, tensor/dev_ops.inc) and the learning-rate schedule.
#pragma once
#include <cstdint>
#include <string>

namespace q3vl {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

struct Schedule {
  std::string kind = "cosine";  // cosine | linear | constant
  double lr = 1e-4, min_lr_ratio = 0.0;
  int64_t warmup = 0, total = 1;
  // Learning rate of optimizer step `step` (0-based): linear warmup from lr/warmup to lr, then decay to
  // lr*min_lr_ratio at step total-1.
  double at(int64_t step) const;
};

}  // namespace q3vl
