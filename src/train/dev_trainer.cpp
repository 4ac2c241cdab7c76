#include "q3vl/train/dev_trainer.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "q3vl/core/error.hpp"

namespace q3vl {

DevBudget train_budget(const ModelConfig& cfg, int64_t micro_batch, int64_t seq_len, int64_t max_patches) {
  DevBudget b;
  b.tokens = micro_batch * seq_len;
  b.patches = max_patches > 0 ? max_patches : b.tokens * cfg.vision.merge * cfg.vision.merge;
  b.segments = b.tokens;  // packed samples: at most one per token (4 bytes each)
  return b;
}

DevTrainerMemory DevTrainer::plan(const ModelConfig& cfg, DType dt, const DevBudget& budget, bool recompute,
                                  Device d) {
  DevTrainerMemory m;
  m.model = DevModel::plan(cfg, dt, budget, recompute, d == Device::CUDA ? kWorkspaceBytes : 0);
  m.optimizer = 3 * moment_bytes(ParamTable(cfg)) + kNormBytes;
  return m;
}

DevTrainerMemory DevTrainer::memory() const {
  DevTrainerMemory m;
  m.model = model_->memory();
  m.optimizer = 3 * moment_bytes(*table_) + kNormBytes;
  return m;
}

DevTrainer::DevTrainer(Device d, int gpu, const ModelConfig& cfg, const std::vector<bool>& trainable, DType dt,
                       const DevBudget& budget, bool recompute, LossScaling ls)
    : ex_(dev::make_exec(d, size_t(kWorkspaceBytes), gpu)), trainable_(trainable), ls_(ls) {
  model_ = std::make_unique<DevModel>(cfg, ex_, dt);
  model_->set_recompute(recompute);
  model_->reserve(budget);
  table_ = &model_->table();
  const int64_t n = table_->total();
  master_ = static_cast<float*>(dev::alloc(ex_, size_t(moment_bytes(*table_))));
  m_ = static_cast<float*>(dev::alloc(ex_, size_t(moment_bytes(*table_))));
  v_ = static_cast<float*>(dev::alloc(ex_, size_t(moment_bytes(*table_))));
  norm_ = static_cast<double*>(dev::alloc(ex_, size_t(kNormBytes)));
  dev::fill(ex_, m_, DType::F32, n, 0.f);
  dev::fill(ex_, v_, DType::F32, n, 0.f);
  for (size_t i = 0; i < table_->params().size(); ++i) {
    if (!trainable_[i]) continue;
    const ParamInfo& p = table_->param(int(i));
    const int64_t off = table_->units()[p.unit].offset + p.offset;
    if (!runs_.empty() && runs_.back().off + runs_.back().n == off && runs_.back().no_decay == p.no_decay)
      runs_.back().n += p.numel;
    else
      runs_.push_back({off, p.numel, p.no_decay});
  }
}

DevTrainer::~DevTrainer() {
  dev::synchronize(ex_);
  model_.reset();
  for (void* p : {(void*)master_, (void*)m_, (void*)v_, (void*)norm_}) dev::release(ex_, p);
  dev::destroy_exec(ex_);
}

void DevTrainer::from_host(const ZeroEngine& e) {
  for (const ShardPiece& sp : e.pieces()) {
    const ParamInfo& p = table_->param(sp.param);
    const int64_t off = table_->units()[p.unit].offset + p.offset + sp.begin;
    const size_t bytes = size_t(sp.count) * 4;
    dev::to_device(ex_, master_ + off, sp.master, bytes);
    if (sp.exp_avg) dev::to_device(ex_, m_ + off, sp.exp_avg, bytes);
    if (sp.exp_avg_sq) dev::to_device(ex_, v_ + off, sp.exp_avg_sq, bytes);
  }
  model_->set_params_from_device(master_);
  dev::synchronize(ex_);
}

void DevTrainer::to_host(const ZeroEngine& e) const {
  for (const ShardPiece& sp : e.pieces()) {
    const ParamInfo& p = table_->param(sp.param);
    const int64_t off = table_->units()[p.unit].offset + p.offset + sp.begin;
    const size_t bytes = size_t(sp.count) * 4;
    dev::to_host(ex_, sp.master, master_ + off, bytes);
    if (sp.exp_avg) dev::to_host(ex_, sp.exp_avg, m_ + off, bytes);
    if (sp.exp_avg_sq) dev::to_host(ex_, sp.exp_avg_sq, v_ + off, bytes);
  }
}

void DevTrainer::begin_step() { model_->zero_grads(); }

double DevTrainer::forward(const PackedBatch& b, double* aux_out, bool aux_loss) {
  return model_->forward(b, true, nullptr, aux_out, aux_loss);
}

void DevTrainer::backward(double weight) { model_->backward(float(weight * (ls_.on ? ls_.scale : 1.0))); }

double DevTrainer::grad_norm_sq(bool* finite) {
  const double zero[2] = {0, 0};
  dev::to_device(ex_, norm_, zero, sizeof zero);
  auto* bad = reinterpret_cast<int32_t*>(norm_ + 1);
  for (const Run& r : runs_) dev::sum_squares(ex_, model_->grads() + r.off, r.n, DType::F32, norm_, bad);
  double got[2];
  dev::to_host(ex_, got, norm_, sizeof got);
  int32_t nonfinite;
  std::memcpy(&nonfinite, &got[1], 4);
  *finite = nonfinite == 0 && std::isfinite(got[0]);
  const double s = ls_.on ? ls_.scale : 1.0;
  return got[0] / (s * s);
}

void DevTrainer::update(const AdamWConfig& hp, double lr, double gscale, int64_t t) {
  const double g = gscale / (ls_.on ? ls_.scale : 1.0);  // unscale inside the update
  for (const Run& r : runs_)
    dev::adamw(ex_, master_ + r.off, model_->grads() + r.off, m_ + r.off, v_ + r.off, r.n, hp.beta1, hp.beta2, hp.eps,
               lr, r.no_decay ? 0.0 : hp.weight_decay, g, t);
  model_->set_params_from_device(master_);
}

void DevTrainer::after_step(bool finite) {
  if (!ls_.on) return;
  if (!finite) {
    ls_.scale = std::max(1.0, ls_.scale / 2);
    ls_.good = 0;
  } else if (++ls_.good >= ls_.window) {
    ls_.scale *= 2;
    ls_.good = 0;
  }
}

std::string DevTrainer::memory_report() const {
  const DevMemory m = model_->memory();
  size_t free_b = 0, total_b = 0;
  dev::memory_info(ex_, &free_b, &total_b);
  const double MiB = 1 << 20;
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "GPU memory: weights %.0f MiB (%s), gradients %.0f MiB, fp32 masters + AdamW %.0f MiB, activations "
                "%.0f MiB (arena), workspace %.0f MiB; %.0f MiB free of %.0f MiB",
                m.weights / MiB, dtype_name(model_->dtype()), m.grads / MiB, 3.0 * table_->total() * 4 / MiB,
                m.activations / MiB, m.workspace / MiB, free_b / MiB, total_b / MiB);
  return buf;
}

}  // namespace q3vl
