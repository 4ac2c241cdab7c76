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

// The arena budget train sizes the GPU for: the largest micro-batch the loader can make. An image token stands for
// merge^2 patches; max_patches (train.max_patches, 0: as if every token were an image token) bounds them.
DevBudget train_budget(const ModelConfig& cfg, int64_t micro_batch, int64_t seq_len, int64_t max_patches);

// A DevTrainer's device memory by kind: the model's, plus fp32 masters, both AdamW moments and the norm scratch.
struct DevTrainerMemory {
  DevMemory model;
  int64_t optimizer = 0;
  int64_t total() const { return model.total() + optimizer; }
};

class DevTrainer {
 public:
  static constexpr int64_t kWorkspaceBytes = int64_t(256) << 20;  // the Exec's GEMM/attention workspace
  static constexpr int64_t kNormBytes = 16;                       // norm sum + non-finite count
  // What a DevTrainer built with these arguments allocates on its device, without allocating (the planner's sizing).
  // (A CPU Exec has no workspace: tests size the CPU op layer with Device::CPU.)
  static DevTrainerMemory plan(const ModelConfig& cfg, DType dt, const DevBudget& budget, bool recompute,
                               Device d = Device::CUDA);
  static int64_t moment_bytes(const ParamTable& t) { return t.total() * 4; }  // one of master, m, v
  // On the GPU in training; the CPU (fp32) runs the same code in tests.
  DevTrainer(Device d, int gpu, const ModelConfig& cfg, const std::vector<bool>& trainable, DType dt, const DevBudget& budget,
             bool recompute, LossScaling ls);
  ~DevTrainer();

  // Masters and moments from the engine's pieces (one rank: each piece a whole tensor), and the compute weights.
  void from_host(const ZeroEngine& e);
  void to_host(const ZeroEngine& e) const;

  void begin_step();
  // Loss of a micro-batch (kept for backward); backward adds weight * its gradient (weight = n / n_global).
  double forward(const PackedBatch& b, double* aux_out = nullptr, bool aux_loss = false);
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
  DevTrainerMemory memory() const;  // what this trainer allocated on its device
  int64_t device_bytes() const { return memory().total(); }

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
