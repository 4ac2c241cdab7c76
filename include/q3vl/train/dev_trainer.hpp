// Training state on one GPU (model.backend = "cuda"): the device model, fp32 master weights and AdamW moments in
// device memory, the gradient norm, AdamW and dynamic fp16 loss scaling there. The ZeRO engine's host shards stay
// what checkpoints read and write: to_host before a checkpoint, from_host after start-up or a resume.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/model/dev_model.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/train/optim.hpp"

namespace q3vl {

struct LossScaling {
  bool on = false;        // fp16 compute
  double scale = 1;       // current scale (the loss gradient is multiplied by it)
  int64_t window = 1000;  // good steps before the scale doubles
  int64_t good = 0;       // good steps since the last change
};

class DevTrainer {
 public:
  // On the GPU in training; the CPU (fp32) runs the same code in tests.
  DevTrainer(Device d, int gpu, const ModelConfig& cfg, const std::vector<bool>& trainable, DType dt, const DevBudget& budget,
             bool recompute, LossScaling ls);
  ~DevTrainer();

  // Masters and moments from the engine's pieces (one rank: each piece a whole tensor), and the compute weights.
  void from_host(const ZeroEngine& e);
  void to_host(const ZeroEngine& e) const;

  void begin_step();
  // Loss of a micro-batch (kept for backward); backward adds weight * its gradient (weight = n / n_global).
  double forward(const PackedBatch& b);
  int64_t supervised_tokens() const { return model_->supervised_tokens(); }
  void backward(double weight);
  // Squared norm of the (unscaled) gradient of the trainable parameters; false when any element is not finite.
  double grad_norm_sq(bool* finite);
  // AdamW on every trainable parameter (gscale: clipping), then the compute weights from the masters.
  void update(const AdamWConfig& hp, double lr, double gscale, int64_t t);
  // Dynamic loss scaling after a step: an overflow halves the scale, `window` good steps double it.
  void after_step(bool finite);
  const LossScaling& loss_scaling() const { return ls_; }
  void set_loss_scale(double s) { ls_.scale = s; }

  std::string memory_report() const;
  int64_t device_bytes() const;  // everything this trainer allocated on the GPU

 private:
  struct Run {  // adjacent parameters with the same flags: one optimizer launch
    int64_t off = 0, n = 0;
    bool no_decay = false;
  };
  dev::Exec ex_;
  std::unique_ptr<DevModel> model_;
  const ParamTable* table_ = nullptr;
  std::vector<bool> trainable_;
  std::vector<Run> runs_;
  float *master_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  double* norm_ = nullptr;  // [0] sum of squares; the int32 non-finite count follows
  LossScaling ls_;
};

}  // namespace q3vl
