#include "q3vl/parallel/zero.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "q3vl/core/dtype.hpp"
#include "q3vl/core/error.hpp"

namespace q3vl {

ZeroLayout zero_layout(const ParamTable& t, ShardGroup shard, const ShardGroup* experts, int stage,
                       const std::vector<bool>& trainable) {
  Q3VL_CHECK(stage >= 1 && stage <= 3, "ZeRO stage must be 1, 2 or 3");
  Q3VL_CHECK(trainable.size() == t.params().size(), "one trainable flag per parameter");
  ZeroLayout L;
  for (const UnitInfo& ui : t.units()) {
    ZeroUnit u;
    u.experts = experts && ui.experts;
    const int n = u.experts ? experts->size : shard.size, r = u.experts ? experts->rank : shard.rank;
    Q3VL_CHECK(n >= 1 && r >= 0 && r < n, "ZeRO layout: rank outside the shard group");
    u.numel = ui.numel;
    u.shard = ZeroEngine::shard_size(ui.numel, n);
    u.lo = std::min<int64_t>(int64_t(r) * u.shard, ui.numel);
    u.count = std::min<int64_t>(u.lo + u.shard, ui.numel) - u.lo;
    for (int p : ui.params) u.trainable = u.trainable || trainable[p];
    for (int q = 0; q < n; ++q) {
      int64_t lo = std::min<int64_t>(int64_t(q) * u.shard, ui.numel);
      u.counts.push_back(size_t(std::min<int64_t>(lo + u.shard, ui.numel) - lo));
      u.displs.push_back(size_t(int64_t(q) * u.shard));
    }
    u.piece_lo = L.pieces.size();
    u.master_off = L.master;
    L.master += u.shard;
    if (u.trainable) u.comm_off = L.comm, L.comm += u.shard;
    for (int p : ui.params) {
      const ParamInfo& pi = t.param(p);
      int64_t a = std::max(u.lo, pi.offset), b = std::min(u.lo + u.count, pi.offset + pi.held);
      if (a >= b) continue;
      ShardPiece sp;
      sp.param = p;
      sp.begin = pi.held_begin + (a - pi.offset);  // in the whole tensor: checkpoints and loaders see full shapes
      sp.count = b - a;
      sp.trainable = trainable[p];
      sp.no_decay = pi.no_decay;
      L.pieces.push_back(sp);
      L.offs.push_back({u.master_off + (a - u.lo), u.comm_off + (a - u.lo), sp.trainable ? L.opt : -1});
      if (sp.trainable) L.opt += sp.count;
    }
    u.piece_hi = L.pieces.size();
    L.units.push_back(std::move(u));
  }
  if (stage == 1) L.full_grads = t.total();  // stage 1 accumulates full gradients, reduce-scattered once per step
  return L;
}

ZeroEngine::ZeroEngine(Model& model, Comm& shard, Comm* replica, int stage, const std::vector<bool>& trainable,
                       ExpertParallel* ep)
    : model_(model), shard_(shard), replica_(replica), ep_(ep), stage_(stage), trainable_(trainable) {
  const ParamTable& t = model.table();
  Q3VL_CHECK(stage == 3 || model.params(), "ZeRO stages 1/2 compute on the model's full weights: build it with storage");
  Q3VL_CHECK(!ep || (ep->size() == t.ep().size && ep->rank() == t.ep().rank),
             "the expert-parallel group is not the model's expert split");
  Q3VL_CHECK(!ep || !replica || replica->size() == 1, "expert parallelism with hybrid sharding is not supported");
  const ShardGroup experts = ep ? ShardGroup{ep->replicas().size(), ep->replicas().rank()} : ShardGroup{};
  ZeroLayout L = zero_layout(t, {shard.size(), shard.rank()}, ep ? &experts : nullptr, stage, trainable);
  units_ = std::move(L.units);
  pieces_ = std::move(L.pieces);
  master_.assign(L.master, 0.f);
  comm_buf_.assign(L.comm, 0.f);
  exp_avg_.assign(L.opt, 0.f);
  exp_avg_sq_.assign(L.opt, 0.f);
  grads_.assign(L.opt, 0.f);
  full_grads_.assign(L.full_grads, 0.f);
  for (size_t i = 0; i < pieces_.size(); ++i) {
    ShardPiece& sp = pieces_[i];
    sp.master = master_.data() + L.offs[i].master;
    if (sp.trainable) {
      sp.grad = grads_.data() + L.offs[i].opt;
      sp.exp_avg = exp_avg_.data() + L.offs[i].opt;
      sp.exp_avg_sq = exp_avg_sq_.data() + L.offs[i].opt;
    }
  }
  comm_offs_.resize(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) comm_offs_[i] = L.offs[i].comm;
  if (stage_ == 3) stream_setup();
}

ZeroEngine::~ZeroEngine() {
  if (stage_ == 3) model_.set_hooks(nullptr);
}

ZeroMemory ZeroEngine::memory() const {
  ZeroMemory m;
  m.master = int64_t(master_.size()) * 4;
  m.exp_avg = int64_t(exp_avg_.size()) * 4;
  m.exp_avg_sq = int64_t(exp_avg_sq_.size()) * 4;
  m.grads = int64_t(grads_.size() + full_grads_.size()) * 4;
  m.comm = int64_t(comm_buf_.size()) * 4;
  m.working = stage_ == 3 ? held_peak_ : model_.table().total() * 8;
  if (stage_ == 3) m.pool_bound = stream_bound();
  return m;
}

// The bytes of a zero_layout as memory() reports them (stage 3's pool aside).
static ZeroMemory layout_bytes(const ParamTable& t, const ZeroLayout& L, int stage) {
  ZeroMemory m;
  m.master = L.master * 4;
  m.exp_avg = m.exp_avg_sq = L.opt * 4;
  m.grads = (L.opt + L.full_grads) * 4;
  m.comm = L.comm * 4;
  if (stage != 3) m.working = t.total() * 8;
  return m;
}

ZeroMemory ZeroEngine::plan(const ParamTable& t, int n, int r, int stage, const std::vector<bool>& trainable,
                            const std::vector<int>& backward_order, const ShardGroup* experts) {
  ZeroMemory m = layout_bytes(t, zero_layout(t, {n, r}, experts, stage, trainable), stage);
  if (stage == 3) {
    const PoolSlots s = pool_slots(t, backward_order);
    m.pool_bound = 4 * s.biggest * (s.params + s.grads);
  }
  return m;
}

ZeroMemory ZeroEngine::estimate(const ModelConfig& cfg, const ZeroSpec& l, const std::vector<bool>& trainable) {
  if (const std::string e = expert_layout_error(cfg, l.world, l.ep); !e.empty()) fail(e);
  const ParamTable t(cfg, {l.ep, 0});  // every EP rank holds as many experts
  const ShardGroup experts{l.world / l.ep, 0};
  return layout_bytes(t, zero_layout(t, {l.hybrid ? l.node_ranks : l.world, 0}, l.ep > 1 ? &experts : nullptr,
                                     l.stage, trainable), l.stage);
}

ZeroMemory ZeroEngine::unsharded() const {
  const ParamTable& t = model_.table();
  int64_t trainable = 0, all = 0;  // whole tensors (expert parallelism holds only some experts: not t.total())
  for (size_t p = 0; p < t.params().size(); ++p) {
    all += t.param(int(p)).numel;
    if (trainable_[p]) trainable += t.param(int(p)).numel;
  }
  ZeroMemory m;
  m.master = all * 4;
  m.exp_avg = m.exp_avg_sq = m.grads = trainable * 4;
  m.working = all * 8;
  return m;
}

std::string ZeroEngine::memory_report() const {
  const ZeroMemory m = memory(), u = unsharded();
  auto mib = [](int64_t b) { return double(b) / (1 << 20); };
  const std::string ep_note = ep_ ? "; experts: " + std::to_string(ep_->size()) + "-way expert parallel, " +
                                        std::to_string(ep_->replicas().size()) + "-way shards"
                                  : "";
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "memory per rank (ZeRO stage %d, %d-way shards%s%s):\n"
                "  %-30s %12s %12s\n"
                "  %-30s %10.2f MiB %10.2f MiB\n"
                "  %-30s %10.2f MiB %10.2f MiB\n"
                "  %-30s %10.2f MiB %10.2f MiB\n"
                "  %-30s %10.2f MiB %10.2f MiB\n"
                "  %-30s %10.2f MiB %10.2f MiB  (%.3f of unsharded)\n"
                "  %-30s %10.2f MiB\n"
                "  %-30s %10.2f MiB  (%s)",
                stage_, shard_.size(), replica_ && replica_->size() > 1 ? ", hybrid" : "", ep_note.c_str(), "",
                "this rank",
                "unsharded", "fp32 master weights", mib(m.master), mib(u.master), "AdamW exp_avg", mib(m.exp_avg),
                mib(u.exp_avg), "AdamW exp_avg_sq", mib(m.exp_avg_sq), mib(u.exp_avg_sq), "gradient accumulator",
                mib(m.grads), mib(u.grads), "total ZeRO state", mib(m.state()), mib(u.state()),
                u.state() ? double(m.state()) / double(u.state()) : 0.0, "reduce-scatter buffer", mib(m.comm),
                "gathered working set", mib(stage_ == 3 ? m.pool_bound : m.working),
                stage_ == 3 ? "at most: pool of full-unit params + grads, each unit only while in use"
                            : "Model's full params + grads, held during the whole run");
  std::string out = buf;
  const int64_t mine = m.state() + m.comm + (stage_ == 3 ? m.pool_bound : m.working);
  std::snprintf(buf, sizeof buf, "\n  %-30s %10.2f MiB %10.2f MiB  (%.3f of unsharded)", "params + grads + optimizer",
                mib(mine), mib(u.state() + u.working), double(mine) / double(u.state() + u.working));
  return out + buf;
}

void ZeroEngine::load_from_model() {
  const float* full = model_.params();
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = units_[i];
    const float* src = full + model_.table().units()[i].offset + u.lo;
    std::copy(src, src + u.count, master_.data() + u.master_off);
  }
  shards_filled();
}

std::vector<ParamSlice> ZeroEngine::master_slices() const {
  std::vector<ParamSlice> out;
  for (const ShardPiece& p : pieces_) out.push_back({p.param, p.begin, p.count, p.master});
  return out;
}

void ZeroEngine::shards_filled() {
  if (stage_ == 3) {  // from here on units exist in full only while used
    model_.release_storage();
    model_.set_hooks(&hooks_);
  }
}

void ZeroEngine::gather_params() {
  if (stage_ == 3) return;
  std::vector<std::unique_ptr<CommRequest>> reqs;
  std::vector<Comm*> comms;
  std::vector<size_t> done;
  // bf16: the rounded shards go out of one buffer and the gathered units land in another, 2 bytes an element.
  std::vector<uint16_t> send, recv;
  if (gather_bf16_) {
    send.resize(master_.size());
    recv.resize(size_t(model_.table().total()));
  }
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = units_[i];
    // Only the units the optimizer changed need a new gather after the first.
    if (!u.trainable && gathered_once_) continue;
    const int64_t off = model_.table().units()[i].offset;
    if (gather_bf16_) f32_to_bf16(master_.data() + u.master_off, u.count, send.data() + u.master_off);
    Comm& c = comm(u);
    comms.push_back(&c);
    reqs.push_back(gather_bf16_ ? c.iall_gatherv(send.data() + u.master_off, size_t(u.count), recv.data() + off,
                                                      u.counts, u.displs, DType::BF16)
                                : c.iall_gatherv(master_.data() + u.master_off, size_t(u.count),
                                                      model_.params() + off, u.counts, u.displs, DType::F32));
    gathered_bytes_ += u.numel * (gather_bf16_ ? 2 : 4);
    done.push_back(i);
  }
  for (size_t i = 0; i < reqs.size(); ++i) comms[i]->wait(std::move(reqs[i]));
  if (gather_bf16_)
    for (size_t i : done) {
      const UnitInfo& ui = model_.table().units()[i];
      bf16_to_f32(recv.data() + ui.offset, ui.numel, model_.params() + ui.offset);
    }
  gathered_once_ = true;
}

void ZeroEngine::begin_step() {
  std::fill(grads_.begin(), grads_.end(), 0.f);
  std::fill(full_grads_.begin(), full_grads_.end(), 0.f);
}

void ZeroEngine::before_forward() {
  if (stage_ == 3) begin_pass(false);
}

void ZeroEngine::before_backward(double scale) {
  scale_ = scale;
  if (ep_) ep_->set_scale(scale);  // owners scale the expert gradients of each rank's tokens
  if (stage_ == 3) {
    end_pass();
    begin_pass(true);
    return;
  }
  wait_reduce();
  model_.zero_grads();
}

void ZeroEngine::after_backward() {
  if (stage_ == 3) return end_pass();
  const double scale = scale_;
  const ParamTable& t = model_.table();
  for (size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = units_[i];
    if (!u.trainable) continue;
    float* g = model_.grads() + t.units()[i].offset;
    const float s = u.experts ? 1.f : float(scale);  // expert units: scaled per source rank by the MoE block
    if (stage_ == 1) {
      float* acc = full_grads_.data() + t.units()[i].offset;
      for (int64_t j = 0; j < u.numel; ++j) acc[j] += s * g[j];
    } else {
      for (int64_t j = 0; j < u.numel; ++j) g[j] *= s;
      pending_.emplace_back(&comm(u), comm(u).ireduce_scatterv(g, comm_buf_.data() + u.comm_off, u.counts,
                                                               DType::F32, ReduceOp::Sum));
    }
  }
}

void ZeroEngine::wait_reduce() {
  if (pending_.empty()) return;
  for (auto& [c, r] : pending_) c->wait(std::move(r));
  pending_.clear();
  accumulate_comm();
}

void ZeroEngine::accumulate_comm() {
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const ShardPiece& sp = pieces_[i];
    if (!sp.trainable) continue;
    const float* src = comm_buf_.data() + comm_offs_[i];
    for (int64_t j = 0; j < sp.count; ++j) sp.grad[j] += src[j];
  }
}

void ZeroEngine::finish_grads() {
  wait_reduce();
  if (stage_ == 1) {
    const ParamTable& t = model_.table();
    for (size_t i = 0; i < units_.size(); ++i) {
      const Unit& u = units_[i];
      if (!u.trainable) continue;
      pending_.emplace_back(&comm(u), comm(u).ireduce_scatterv(full_grads_.data() + t.units()[i].offset,
                                                               comm_buf_.data() + u.comm_off, u.counts, DType::F32,
                                                               ReduceOp::Sum));
    }
    for (auto& [c, r] : pending_) c->wait(std::move(r));
    pending_.clear();
    accumulate_comm();
  }
  if (replica_ && replica_->size() > 1 && !grads_.empty())
    replica_->all_reduce(grads_.data(), grads_.size(), DType::F32, ReduceOp::Sum);
}

double ZeroEngine::grad_norm_sq() {
  double s = 0;
  for (float g : grads_) s += double(g) * double(g);
  return shard_.sum(s);
}

void ZeroEngine::after_update() {
  if (stage_ != 3) gather_params();
}

void ZeroEngine::poison_grads() {
  if (!grads_.empty()) grads_[0] = std::numeric_limits<float>::quiet_NaN();
}

}  // namespace q3vl
