#include "q3vl/train/dev_trainer.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>

#include "q3vl/core/env.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/runtime/nccl_comm.hpp"
#include "q3vl/tensor/dev_host.hpp"
#include "q3vl/tensor/dev_stream.hpp"

namespace q3vl {

DevBudget train_budget(const ModelConfig& cfg, int64_t micro_batch, int64_t seq_len, int64_t max_patches) {
  DevBudget b;
  b.tokens = micro_batch * seq_len;
  b.patches = max_patches > 0 ? max_patches : b.tokens * cfg.vision.merge * cfg.vision.merge;
  b.segments = b.tokens;  // packed samples: at most one per token (4 bytes each)
  return b;
}

DevTrainerMemory DevTrainer::plan(const ModelConfig& cfg, DType dt, const DevBudget& budget, bool recompute,
                                  const std::vector<bool>& trainable, int group, int stage, Device d,
                                  bool gather_bf16, const Offload& off) {
  const ParamTable t(cfg, {budget.ep, 0});  // under expert parallelism: E/ep experts a layer
  DevTrainerMemory m;
  m.model.weights = stage == 3 ? 0 : int64_t(dtype_size(dt)) * [&] {
    int64_t n = 0;
    for (const UnitInfo& u : t.units()) n += DevModel::padded(u.numel, group);
    return n;
  }();
  m.model.grads = stage == 3 ? 0 : m.model.weights / int64_t(dtype_size(dt)) * 4;
  m.model.activations = DevModel::activation_bytes(cfg, dt, budget, recompute);
  m.model.workspace = d == Device::CUDA ? kWorkspaceBytes : 0;
  m.zero = DevZero::plan(t, group, stage, trainable, dt, gather_bf16 && dt == DType::F32 ? DType::BF16 : dt, off,
                         off.in_place);
  m.norm = norm_bytes(int64_t(t.params().size()));
  return m;
}

DevTrainerMemory DevTrainer::memory() const {
  DevTrainerMemory m;
  m.model = model_->memory();
  m.zero = zero_->memory();
  m.norm = norm_bytes(int64_t(model_->table().params().size()));
  return m;
}

namespace {
std::unique_ptr<Comm> nccl_over(const Comm& c, const dev::Exec& ex) {
  const auto* m = dynamic_cast<const MpiComm*>(&c);
  Q3VL_CHECK(m, "DevTrainer: the shard group must be an MPI communicator (NCCL is made over its ranks)");
  return make_nccl_comm(m->handle(), ex, c.timeout());
}
}  // namespace

DevTrainer::DevTrainer(Device d, int gpu, const ModelConfig& cfg, const std::vector<bool>& trainable, DType dt,
                       const DevBudget& budget, bool recompute, LossScaling ls, Comm& shard, Comm* replica, int stage,
                       bool gather_bf16, ExpertParallel* ep, const Offload& off)
    : ex_(dev::make_priority_exec(d, size_t(kWorkspaceBytes), gpu)), shard_(shard), ls_(ls) {
  // GPU ranks exchange device buffers over NCCL; CPU ranks' buffers are host memory, which MPI moves.
  Comm* dshard = &shard;
  Comm* drep = replica && replica->size() > 1 ? replica : nullptr;
  hybrid_ = drep != nullptr;
  // NCCL runs on a stream of its own (cx_), so that a unit's gather overlaps the compute before it.
  // Both above the optimizer's stream (DevZero::update_runs overlaps the update with the next forward).
  if (d == Device::CUDA && (shard.size() > 1 || drep)) cx_ = dev::make_priority_exec(d, 0, gpu);
  if (d == Device::CUDA && shard.size() > 1) nccl_shard_ = nccl_over(shard, cx_), dshard = nccl_shard_.get();
  if (d == Device::CUDA && drep) nccl_replica_ = nccl_over(*drep, cx_), drep = nccl_replica_.get();
  // Expert parallelism: rows over the group in order with the model's kernels; expert units over their replicas.
  DevBudget b = budget;
  Comm* dexperts = nullptr;
  if (ep && ep->size() > 1) {
    ep_ = ep, b.ep = ep->size(), dexperts = &ep->replicas();
    if (d == Device::CUDA) ep->set_rows_comm((nccl_ep_ = nccl_over(ep->group(), ex_)).get());
    if (d == Device::CUDA && dexperts->size() > 1) dexperts = (nccl_experts_ = nccl_over(*dexperts, cx_)).get();
  }
  model_ = std::make_unique<DevModel>(cfg, ex_, dt, true, DevStage{}, QFormat::None,
                                      DevZero::hold(dshard->size(), stage), ep_ ? ep_->split() : ExpertSplit{});
  model_->set_recompute(recompute);
  model_->set_loss_in_backward(true);  // each LM-head chunk's logits once a micro-step, not in both passes
  model_->set_frozen(trainable);  // a LoRA base, train.tune_* = false: no weight gradients computed
  model_->set_experts(ep_);
  model_->reserve(b);
  Q3VL_CHECK(!off.in_place || off.state, "DevTrainer: an in-place offload needs the host engine");
  HostState hs;
  if (off.optimizer && off.state)
    hs = {off.state->master_data(), off.state->exp_avg_data(), off.state->exp_avg_sq_data()};
  zero_ = std::make_unique<DevZero>(*model_, *dshard, drep, stage, trainable, cx_.stream ? &cx_ : nullptr,
                                    gather_bf16 && dt == DType::F32 ? DType::BF16 : dt, dexperts, off,
                                    off.optimizer && off.state ? &hs : nullptr);
  const int64_t np = int64_t(model_->table().params().size());
  norm_ = static_cast<double*>(dev::alloc(ex_, size_t(norm_bytes(np))));
  // Where the backward's gradients are final as the model writes them (in place in the shard, no replica sum after
  // it), the ops that can take their squares as they write them do, and the norm skips those gradients.
  // Q3VL_GRAD_SQUARES=0: the norm reads every gradient (A/B runs).
  if (zero_->in_place_grads_final() && !env_is("Q3VL_GRAD_SQUARES", "0")) sq_ = norm_ + 2;
  if (off.optimizer) pool_ = std::make_unique<ThreadPool>(off.ring.threads, off.pin);
  delayed_ = off.optimizer && off.delayed;
}

DevTrainer::~DevTrainer() {
  if (pending_.valid()) pending_.wait();  // its failure, if any, is moot now
  dev::synchronize(ex_);
  zero_.reset();
  model_.reset();
  dev::release(ex_, norm_);
  if (ids_dev_) dev::release(ex_, ids_dev_), dev::host_release(ex_, ids_host_);
  if (ep_) ep_->set_rows_comm(nullptr);
  nccl_ep_.reset();
  nccl_experts_.reset();
  nccl_replica_.reset();
  nccl_shard_.reset();
  if (cx_.stream) dev::destroy_exec(cx_);
  dev::destroy_exec(ex_);
}

std::string DevTrainer::comm_kind() const { return nccl_shard_ ? "nccl" : shard_.size() > 1 ? "mpi" : "none"; }

void DevTrainer::from_host(const ZeroShards& e) {
  settle();
  zero_->from_host(e.pieces());
  zero_->refresh_params();
  dev::synchronize(ex_);
}

void DevTrainer::to_host(const ZeroShards& e) {
  settle();
  zero_->to_host(e.pieces());
}

void DevTrainer::begin_step() {
  zero_->begin_step();
  if (!sq_) return;
  const int64_t np = int64_t(model_->table().params().size());
  dev::fill(ex_, sq_, DType::F32, np * 3, 0.f);  // the slots' sums and counts
  model_->take_grad_squares(sq_, reinterpret_cast<int32_t*>(sq_ + np));
}

void DevTrainer::forward(const PackedBatch& b, bool aux_loss) {
  zero_->begin_pass(false);
  model_->forward(b, true, nullptr, nullptr, aux_loss);
  zero_->end_pass();
}

double DevTrainer::backward(double weight, double* aux_out) {
  zero_->begin_pass(true);
  model_->backward(float(weight * (ls_.on ? ls_.scale : 1.0)));
  zero_->end_pass();
  zero_->after_backward();
  return model_->loss(aux_out);  // after the pass's collectives are queued: the wait hides nothing of them
}

void DevTrainer::idle() {
  if (!ep_) return zero_->idle();
  zero_->begin_pass(false), model_->idle_pass(false), zero_->end_pass();
  zero_->begin_pass(true), model_->idle_pass(true), zero_->end_pass();
  zero_->after_backward();
}

void DevTrainer::finish_grads() { zero_->finish_grads(); }

// The gradients in the shard whose squares the backward took as it wrote them (sq_): [offset, end) in grads(),
// sorted, with their parameter ids; unit >= 0: that unit's only.
std::vector<DevTrainer::Taken> DevTrainer::taken(int unit) const {
  std::vector<Taken> t;
  if (!sq_) return t;
  const std::vector<const float*>& at = model_->grad_squares_taken();
  const float* g0 = zero_->grads();
  const int64_t total = zero_->layout().comm;
  auto take = [&](int id) {
    if (!at[size_t(id)]) return;
    const int64_t a = at[size_t(id)] - g0, b = a + model_->table().param(id).held;
    if (a >= 0 && b <= total) t.push_back({a, b, id});  // else outside the shard: not one the norm reads
  };
  if (unit >= 0)
    for (int id : model_->table().units()[size_t(unit)].params) take(id);
  else
    for (size_t id = 0; id < at.size(); ++id) take(int(id));
  std::sort(t.begin(), t.end(), [](const Taken& x, const Taken& y) { return x.a < y.a; });
  return t;
}

// The squares of gradients [a, b) of the shard, less the taken ones (sorted and apart), into *sum and *bad on x.
void DevTrainer::sum_less(const dev::Exec& x, int64_t a, int64_t b, const std::vector<Taken>& took, double* sum,
                          int32_t* bad) {
  auto read = [&](int64_t p, int64_t q) {
    if (q > p) dev::sum_squares(x, zero_->grads() + p, q - p, DType::F32, sum, bad);
  };
  for (const Taken& t : took) {  // the gaps between those inside [a, b)
    if (t.b <= a || t.a >= b) continue;
    read(a, t.a);
    a = std::max(a, std::min(t.b, b));
  }
  read(a, b);
}

// The squares of the runs' gradients less the taken ones into sum and bad: runs adjacent in the gradient buffer summed
// as one span (runs split where AdamW's weight decay or placement changes, which the norm does not care about): fewer,
// longer passes. ids: the runs (ascending indices into runs()); null: every run.
void DevTrainer::sum_runs(const dev::Exec& x, const std::vector<int>* ids, const std::vector<Taken>& took, double* sum,
                          int32_t* bad) {
  const std::vector<DevZero::Run>& runs = zero_->runs();
  const size_t n_ids = ids ? ids->size() : runs.size();
  auto run = [&](size_t k) -> const DevZero::Run& { return runs[ids ? size_t((*ids)[k]) : k]; };
  for (size_t i = 0, j; i < n_ids; i = j) {
    int64_t n = run(i).n;
    for (j = i + 1; j < n_ids && run(j).grad == run(i).grad + n; ++j) n += run(j).n;
    sum_less(x, run(i).grad, run(i).grad + n, took, sum, bad);
  }
}

// The update in the backward's check of unit u (DevZero::SqFn), on the update's stream x: the slots of the unit's
// gradients whose squares the backward took (their ids through a pinned staging area, each unit its own part), the
// rest of its runs read.
void DevTrainer::unit_squares(int u, const dev::Exec& x, double* sum, int32_t* bad) {
  const std::vector<Taken> took = taken(u);
  sum_runs(x, &zero_->unit_runs(u), took, sum, bad);
  if (took.empty()) return;
  int32_t* h = ids_host_ + id_off_[size_t(u)];
  for (size_t k = 0; k < took.size(); ++k) h[k] = took[k].id, took_bytes_ += (took[k].b - took[k].a) * 4;
  dev::to_device(x, ids_dev_ + id_off_[size_t(u)], h, took.size() * 4);
  const int64_t np = int64_t(model_->table().params().size());
  dev::sum_slots(x, sq_, reinterpret_cast<const int32_t*>(sq_ + np), ids_dev_ + id_off_[size_t(u)],
                 int64_t(took.size()), sum, bad);
  took_n_ += int64_t(took.size());
}

// The taken gradients' slots added to *sum and *nonfinite in parameter order (a fixed order); the log says once
// what was taken.
void DevTrainer::add_taken(const std::vector<Taken>& took, double* sum, int32_t* nonfinite) {
  if (took.empty()) return;
  const int64_t np = int64_t(model_->table().params().size());
  std::vector<double> s(static_cast<size_t>(np));
  std::vector<int32_t> c(static_cast<size_t>(np));
  dev::to_host(ex_, s.data(), sq_, size_t(np) * sizeof(double));
  dev::to_host(ex_, c.data(), sq_ + np, size_t(np) * sizeof(int32_t));
  std::vector<int> ids;
  int64_t n = 0;
  for (const Taken& t : took) ids.push_back(t.id), n += t.b - t.a;
  std::sort(ids.begin(), ids.end());
  for (int id : ids) *sum += s[size_t(id)], *nonfinite += c[size_t(id)];
  if (!told_)
    log_info("gradient norm: " + std::to_string(took.size()) + " gradients (" + bytes_text(double(n) * 4) +
             ") summed as the backward wrote them, not read again");
  told_ = true;
}

double DevTrainer::grad_norm_sq(bool* finite) {
  const double zero[2] = {0, 0};
  dev::to_device(ex_, norm_, zero, sizeof zero);
  const std::vector<Taken> took = taken();
  sum_runs(ex_, nullptr, took, norm_, reinterpret_cast<int32_t*>(norm_ + 1));
  double got[2];
  dev::to_host(ex_, got, norm_, sizeof got);
  int32_t nonfinite;
  std::memcpy(&nonfinite, &got[1], 4);
  add_taken(took, &got[0], &nonfinite);
  double sums[2] = {got[0], double(nonfinite)};
  shard_.all_reduce(sums, 2, DType::F64, ReduceOp::Sum);  // a host reduction of two scalars
  *finite = sums[1] == 0 && std::isfinite(sums[0]);
  const double s = ls_.on ? ls_.scale : 1.0;
  return sums[0] / (s * s);
}

void DevTrainer::update(const AdamWConfig& hp, double lr, double gscale, int64_t t) {
  const double g = gscale / (ls_.on ? ls_.scale : 1.0);  // unscale inside the update
  if (zero_->offloaded()) return host_update(hp, lr, g, t);
  device_adamw(hp, lr, g, t);
  zero_->refresh_params(true);  // device_adamw wrote the parameter copy
}

// The offloaded update (DevZero::host_update streams the chunks). Synchronous: the update, then stages 1/2 gather
// its parameters. Delayed: the previous step's update lands first (settle), then this one starts on its own thread
// while the next step computes on the weights from before it. Partial offload: the device's part is enqueued on the
// model's stream first, so it runs while the host updates its part; it is never delayed.
void DevTrainer::host_update(const AdamWConfig& hp, double lr, double g, int64_t t) {
  if (!delayed_) {
    device_adamw(hp, lr, g, t);
    host_adamw(hp, lr, g, t);
    return zero_->refresh_params();
  }
  settle();
  device_adamw(hp, lr, g, t);  // this step's gradients, before flip() hands them to the host
  zero_->flip();
  pending_ = std::async(std::launch::async, [=, this] { host_adamw(hp, lr, g, t); });
}

// AdamW on the device over the runs whose state it holds: every run (the optimizer on the device), or, offloaded,
// the partial offload's device part (at Run::dev of its compacted buffers). The same pass writes the parameter copy
// the gathers read (DevZero::param_copy; bf16: 2 bytes an element more, where converting the masters after it moved 6).
void DevTrainer::device_adamw(const AdamWConfig& hp, double lr, double g, int64_t t) {
  const bool part = zero_->offloaded();
  if (part && !zero_->dev_master()) return;
  zero_->update_runs([&](const DevZero::Run& r, const dev::Exec& ex, const int32_t*) {
    if (!part || r.dev >= 0) run_adamw(r, ex, hp, lr, g, t, nullptr);
  });
  if (part) zero_->publish_device_part();
}

// One run's AdamW and parameter copy: at the run's offsets into the device's masters and moments, or, offloaded, at
// Run::dev of the partial offload's compacted buffers. skip: a device count; non-zero leaves the run unchanged.
void DevTrainer::run_adamw(const DevZero::Run& r, const dev::Exec& ex, const AdamWConfig& hp, double lr, double g,
                           int64_t t, const int32_t* skip) {
  const bool part = zero_->offloaded();
  float* p = part ? zero_->dev_master() : zero_->master();
  float* m = part ? zero_->dev_exp_avg() : zero_->exp_avg();
  float* v = part ? zero_->dev_exp_avg_sq() : zero_->exp_avg_sq();
  const int64_t x = part ? r.dev : r.master, o = part ? r.dev : r.opt;
  dev::adamw(ex, p + x, zero_->grads() + r.grad, m + o, v + o, r.n, hp.beta1, hp.beta2, hp.eps, lr,
             r.no_decay ? 0.0 : hp.weight_decay, g, t, zero_->param_copy(r), zero_->gather_dtype(), skip);
}

void DevTrainer::enable_update_in_backward() {
  Q3VL_CHECK(!ls_.on, "DevTrainer: the update in the backward has no fp16 loss scaling (an overflow skips a whole step)");
  zero_->enable_unit_update();
  in_bwd_ = true;
  if (!sq_) return;
  const std::vector<UnitInfo>& units = model_->table().units();
  int64_t n = 0;
  for (const UnitInfo& u : units) id_off_.push_back(n), n += int64_t(u.params.size());
  ids_dev_ = static_cast<int32_t*>(dev::alloc(ex_, size_t(std::max<int64_t>(n, 1)) * 4));
  ids_host_ = static_cast<int32_t*>(dev::host_alloc(ex_, size_t(std::max<int64_t>(n, 1)) * 4));
}

// The update in the backward (no offload, no clipping, no loss scale): run_adamw with the unit's non-finite count.
void DevTrainer::arm_update(const AdamWConfig& hp, double lr, int64_t t, bool poison) {
  Q3VL_CHECK(in_bwd_, "DevTrainer: arm_update() without enable_update_in_backward()");
  DevZero::SqFn sq;
  if (sq_) sq = [this](int u, const dev::Exec& x, double* sum, int32_t* bad) { unit_squares(u, x, sum, bad); };
  zero_->arm_update([this, hp, lr, t](const DevZero::Run& r, const dev::Exec& ex, const int32_t* skip) {
    run_adamw(r, ex, hp, lr, 1.0, t, skip);
  }, std::move(sq), poison);
}

DevTrainer::UnitUpdate DevTrainer::unit_update() {
  std::vector<double> sq;
  std::vector<int32_t> bad;
  zero_->unit_sums(&sq, &bad);
  // The squares summed in unit order (a fixed order), then over the ranks with each unit's count of ranks that skipped it.
  std::vector<double> all(sq.size() + 1, 0.0);
  for (size_t u = 0; u < sq.size(); ++u) all[0] += sq[u], all[u + 1] = bad[u] > 0 ? 1.0 : 0.0;
  shard_.all_reduce(all.data(), all.size(), DType::F64, ReduceOp::Sum);
  UnitUpdate r;
  r.norm_sq = all[0];
  const std::vector<UnitInfo>& units = model_->table().units();
  for (size_t u = 0; u < sq.size(); ++u) {
    if (zero_->layout().units[u].trainable) ++r.units;
    if (all[u + 1] == 0) continue;
    if (++r.skipped <= 3) r.names += (r.names.empty() ? "" : ", ") + units[u].name;
  }
  if (r.skipped > 3) r.names += ", ...";
  if (!told_ && took_n_ > 0)
    log_info("gradient norm and the update's check: " + std::to_string(took_n_) + " gradients (" +
             bytes_text(double(took_bytes_)) + ") summed as the backward wrote them, not read again");
  told_ = told_ || took_n_ > 0;
  took_n_ = 0, took_bytes_ = 0;
  return r;
}

void DevTrainer::settle() {
  if (!pending_.valid()) return;
  pending_.get();  // rethrows the update's failure
  zero_->land();
  zero_->refresh_params();
}

// Each range updated by the CPU op layer's AdamW (element by element, so the split over threads and chunks changes
// no bit), in blocks small enough that the conversion to the gathers' dtype reads the masters AdamW just wrote from
// the cache.
void DevTrainer::host_adamw(const AdamWConfig& hp, double lr, double g, int64_t t) {
  float *p = zero_->master(), *m = zero_->exp_avg(), *v = zero_->exp_avg_sq();
  const DType gd = zero_->gather_dtype();
  const dev::Exec cpu{};
  zero_->host_update(*pool_, [&](const DevZero::Run& r, int64_t a0, int64_t n0, const float* gr, void* w) {
    for (int64_t a = 0, n; a < n0; a += n) {
      n = std::min<int64_t>(kHostBlock, n0 - a);
      const int64_t x = r.master + a0 + a, o = r.opt + a0 + a;
      dev::adamw(cpu, p + x, gr + a, m + o, v + o, n, hp.beta1, hp.beta2, hp.eps, lr,
                 r.no_decay ? 0.0 : hp.weight_decay, g, t);
      if (w) dev::convert(cpu, static_cast<char*>(w) + a * int64_t(dtype_size(gd)), gd, p + x, DType::F32, n);
    }
  });
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
  const DevTrainerMemory m = memory();
  size_t free_b = 0, total_b = 0;
  dev::memory_info(ex_, &free_b, &total_b);
  const double MiB = 1 << 20;
  char buf[640];
  std::snprintf(buf, sizeof buf,
                "%s memory per rank (ZeRO stage %d, %d-way shards%s): weights %.3f MiB (%s), gradients %.3f MiB, "
                "fp32 masters %.3f MiB, AdamW moments %.3f MiB, gradient shard %.3f MiB, landing + %s shard %.3f "
                "MiB, unit pool %.3f MiB, activations %.1f MiB (arena), workspace %.0f MiB; total %.1f MiB; %.0f MiB "
                "free of %.0f MiB",
                ex_.device == Device::CUDA ? "GPU" : "device (CPU op layer)", zero_->stage(), shard_.size(),
                ((hybrid_ ? ", hybrid" : "") + (comm_kind() == "none" ? "" : ", " + comm_kind())).c_str(), m.model.weights / MiB,
                dtype_name(model_->dtype()), m.model.grads / MiB, m.zero.master / MiB, m.zero.moments / MiB,
                m.zero.grads / MiB, dtype_name(model_->dtype()), m.zero.comm / MiB, m.zero.pool / MiB,
                m.model.activations / MiB, m.model.workspace / MiB, m.total() / MiB, free_b / MiB, total_b / MiB);
  std::string s = buf;
  if (zero_->offloaded()) {
    const ZeroLayout& L = zero_->layout();
    char streamed[160] = "";
    if (zero_->parameters_on_host())
      std::snprintf(streamed, sizeof streamed, "; parameters streamed up for every gather from %s",
                    zero_->host_param_copy()
                        ? ("their pinned " + std::string(dtype_name(zero_->gather_dtype())) + " copy, " +
                           std::to_string(m.zero.host_params >> 20) + " MiB").c_str()
                        : "the masters");
    std::snprintf(buf, sizeof buf,
                  "; optimizer offloaded to the host (%s, %d thread(s)%s): fp32 masters %.3f MiB, AdamW moments %.3f "
                  "MiB%s, staging %.3f MiB%s",
                  ex_.device == Device::CUDA ? "pinned" : "CPU backend: plain memory", pool_->size(),
                  delayed_ ? ", update delayed a step" : "",
                  double(L.master * 4) / MiB, double(L.opt * 8) / MiB,
                  m.zero.host_master ? "" : " (the host engine's shards, updated in place)", m.zero.host_staging / MiB,
                  streamed);
    s += buf;
    if (const int64_t kept = zero_->device_elems(); kept > 0) {
      std::snprintf(buf, sizeof buf, "; partial offload: %lld of %lld trained elements updated on the device",
                    (long long)kept, (long long)L.opt);
      s += buf;
    }
  }
  return s;
}

}  // namespace q3vl
