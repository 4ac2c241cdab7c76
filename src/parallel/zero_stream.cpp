// ZeRO-3 unit streaming: the unit pool, per-unit prefetch and release, per-unit gradient reduce-scatter
// (include/q3vl/parallel/zero.hpp explains the ordering rules that keep every rank's collectives matched).
#include <algorithm>

#include "q3vl/core/dtype.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/parallel/zero.hpp"

namespace q3vl {

namespace {
// Reduce-scatters in flight before the oldest is waited for: bounds the gradient buffers held.
constexpr size_t kMaxPendingReduces = 2;
}  // namespace

void ZeroEngine::stream_setup() {
  const size_t nu = units_.size();
  // Duplicates (collective): each carries one fixed order of collectives.
  gather_comm_ = shard_.split(0, shard_.rank());
  reduce_comm_ = shard_.split(0, shard_.rank());
  if (ep_) {
    egather_comm_ = ep_->replicas().split(0, ep_->replicas().rank());
    ereduce_comm_ = ep_->replicas().split(0, ep_->replicas().rank());
  }
  order_[0] = model_.unit_order(false);
  order_[1] = model_.unit_order(true);
  last_use_.assign(nu, -1);
  for (size_t k = 0; k < order_[1].size(); ++k) last_use_[size_t(order_[1][k])] = int(k);
  for (size_t u = 0; u < nu; ++u) {
    Q3VL_CHECK(last_use_[u] >= 0, "ZeRO-3: unit " + model_.table().units()[u].name + " is not used by backward");
    rs_order_.push_back(int(u));
  }
  std::sort(rs_order_.begin(), rs_order_.end(), [&](int a, int b) { return last_use_[a] < last_use_[b]; });
  held_.assign(nu, -1);
  gbuf_.resize(nu);
  grads_done_.assign(nu, 0);
}

// Parameters: the slot being used, the prefetched next one and an enclosing use (the LM head's two units).
// Gradients: every unit between its first and last backward use at one point of the order, plus the ones whose
// reduce-scatter is in flight.
ZeroEngine::PoolSlots ZeroEngine::pool_slots(const ParamTable& t, const std::vector<int>& o) {
  const size_t nu = t.units().size();
  PoolSlots s;
  for (const UnitInfo& u : t.units()) s.biggest = std::max(s.biggest, u.numel);
  std::vector<int> first(nu, -1), last(nu, -1);
  for (size_t k = 0; k < o.size(); ++k) {
    if (first[size_t(o[k])] < 0) first[size_t(o[k])] = int(k);
    last[size_t(o[k])] = int(k);
  }
  int64_t open_max = 0;
  for (size_t k = 0; k < o.size(); ++k) {
    int64_t open = 0;
    for (size_t u = 0; u < nu; ++u) open += first[u] <= int(k) && int(k) <= last[u];
    open_max = std::max(open_max, open);
  }
  s.params = 3;
  s.grads = open_max + int64_t(kMaxPendingReduces);
  return s;
}

int64_t ZeroEngine::stream_bound() const {
  const PoolSlots s = pool_slots(model_.table(), order_[1]);
  return 4 * s.biggest * (s.params + s.grads);
}

// Unit buffers are recycled: allocating and zeroing fresh ones at every use cost page faults and memsets that
// made a stage-3 step 4x slower than a stage-2 step on the demo. Released buffers wait in free_ (cache_bytes_)
// for the next unit they fit; held_bytes_ counts every buffer's capacity, in use or cached. A new buffer is made
// only after the cache is emptied, so buffers never outnumber the most ever in use at once.
void ZeroEngine::alloc(std::vector<float>& v, int64_t n, bool zero) {
  auto fit = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (int64_t(it->capacity()) >= n && (fit == free_.end() || it->capacity() < fit->capacity())) fit = it;
  if (fit == free_.end()) {
    // Nothing fits: give the smaller free buffers back rather than keep them beside a new one.
    free_.clear();
    held_bytes_ -= cache_bytes_;
    cache_bytes_ = 0;
    held_bytes_ += 4 * n;
  } else {
    cache_bytes_ -= 4 * int64_t(fit->capacity());
    v.swap(*fit);
    free_.erase(fit);
  }
  v.resize(size_t(n));
  if (zero) std::fill(v.begin(), v.end(), 0.f);
  pool_bytes_ += 4 * n;
  held_peak_ = std::max(held_peak_, held_bytes_);
}

void ZeroEngine::release(std::vector<float>& v) {
  if (v.capacity() == 0) return;
  pool_bytes_ -= 4 * int64_t(v.size());
  cache_bytes_ += 4 * int64_t(v.capacity());
  free_.push_back(std::move(v));
  v = std::vector<float>();
}

void ZeroEngine::begin_pass(bool backward) {
  Q3VL_CHECK(!in_pass_, "ZeRO-3: a pass began before the previous one ended");
  in_pass_ = true;
  backward_ = backward;
  const std::vector<int>& o = order_[backward];
  slots_.clear();
  slots_.resize(o.size());
  for (size_t k = 0; k < o.size(); ++k) slots_[k].unit = o[k];
  next_ = 0;
  if (backward) {
    std::fill(grads_done_.begin(), grads_done_.end(), 0);
    rs_next_ = 0;
  }
  if (!slots_.empty()) issue_gather(0);
}

void ZeroEngine::end_pass() {
  Q3VL_CHECK(in_pass_, "ZeRO-3: a pass ended that never began");
  for (size_t u = 0; u < held_.size(); ++u)
    Q3VL_CHECK(held_[u] < 0, "ZeRO-3: unit " + model_.table().units()[u].name + " still in use at the end of a pass");
  // Units this rank did not use still take part in every collective.
  while (next_ < slots_.size()) {
    enter_slot(next_);
    leave_slot(next_++);
  }
  if (backward_) {
    Q3VL_CHECK(rs_next_ == rs_order_.size(), "ZeRO-3: gradients of some unit were never completed");
    while (!rs_pending_.empty()) complete_reduce();
  }
  in_pass_ = false;
}

void ZeroEngine::issue_gather(size_t k) {
  Slot& s = slots_[k];
  const Unit& u = units_[size_t(s.unit)];
  gathered_bytes_ += u.numel * (gather_bf16_ ? 2 : 4);
  if (!gather_bf16_) {
    alloc(s.buf, u.numel, false);  // the gather writes every element
    s.req = gcomm(u).iall_gatherv(master_.data() + u.master_off, size_t(u.count), s.buf.data(), u.counts,
                                       u.displs, DType::F32);
    return;
  }
  // bf16 halves travel in pool buffers (two per float); enter_slot widens them into s.buf.
  alloc(s.send, (u.count + 1) / 2, false);
  alloc(s.recv, (u.numel + 1) / 2, false);
  uint16_t* snd = reinterpret_cast<uint16_t*>(s.send.data());
  f32_to_bf16(master_.data() + u.master_off, u.count, snd);
  s.req = gcomm(u).iall_gatherv(snd, size_t(u.count), reinterpret_cast<uint16_t*>(s.recv.data()), u.counts,
                                     u.displs, DType::BF16);
}

void ZeroEngine::use(int unit) {
  Q3VL_CHECK(in_pass_, "ZeRO-3: the model used a unit outside before_forward() .. after_backward()");
  Q3VL_CHECK(held_[size_t(unit)] < 0, "ZeRO-3: unit " + model_.table().units()[size_t(unit)].name + " used twice at once");
  while (next_ < slots_.size() && slots_[next_].unit != unit) {
    enter_slot(next_);
    leave_slot(next_++);
  }
  if (next_ == slots_.size())
    fail("ZeRO-3: unit " + model_.table().units()[size_t(unit)].name +
         " used out of Model::unit_order()'s order (a bug: the order must list every use)");
  enter_slot(next_++);
}

void ZeroEngine::unuse(int unit) {
  Q3VL_CHECK(held_[size_t(unit)] >= 0, "ZeRO-3: unit " + model_.table().units()[size_t(unit)].name + " released but not in use");
  leave_slot(size_t(held_[size_t(unit)]));
}

void ZeroEngine::enter_slot(size_t k) {
  Slot& s = slots_[k];
  const size_t u = size_t(s.unit);
  gcomm(units_[u]).wait(std::move(s.req));
  if (gather_bf16_) {
    release(s.send);
    alloc(s.buf, units_[u].numel, false);
    bf16_to_f32(reinterpret_cast<const uint16_t*>(s.recv.data()), units_[u].numel, s.buf.data());
    release(s.recv);
  }
  if (k + 1 < slots_.size()) issue_gather(k + 1);  // prefetch: overlaps this unit's compute
  float* g = nullptr;
  if (backward_) {
    if (gbuf_[u].empty()) alloc(gbuf_[u], units_[u].numel, true);  // backward accumulates into it
    g = gbuf_[u].data();
  }
  model_.bind_unit(int(u), s.buf.data(), g);
  held_[u] = int(k);
}

void ZeroEngine::leave_slot(size_t k) {
  Slot& s = slots_[k];
  const size_t u = size_t(s.unit);
  model_.bind_unit(int(u), nullptr, nullptr);
  held_[u] = -1;
  release(s.buf);
  if (k + 1 < slots_.size() && slots_[k + 1].req) slots_[k + 1].req->test();  // lets MPI progress the prefetch
  if (backward_ && last_use_[u] == int(k)) {
    grads_done_[u] = 1;
    issue_ready_reduces();
  }
}

void ZeroEngine::issue_ready_reduces() {
  while (rs_next_ < rs_order_.size() && grads_done_[size_t(rs_order_[rs_next_])]) {
    const size_t u = size_t(rs_order_[rs_next_++]);
    if (!units_[u].trainable) {
      release(gbuf_[u]);
      continue;
    }
    float* g = gbuf_[u].data();
    if (!units_[u].experts) {  // expert units: scaled per source rank by the MoE block
      const float s = float(scale_);
      for (int64_t j = 0; j < units_[u].numel; ++j) g[j] *= s;
    }
    rs_pending_.emplace_back(int(u), rcomm(units_[u]).ireduce_scatterv(g, comm_buf_.data() + units_[u].comm_off,
                                                                   units_[u].counts, DType::F32, ReduceOp::Sum));
  }
  while (!rs_pending_.empty() && (rs_pending_.size() > kMaxPendingReduces || rs_pending_.front().second->test()))
    complete_reduce();
}

void ZeroEngine::complete_reduce() {
  auto [unit, req] = std::move(rs_pending_.front());
  rs_pending_.erase(rs_pending_.begin());
  const Unit& u = units_[size_t(unit)];
  rcomm(u).wait(std::move(req));
  for (size_t i = u.piece_lo; i < u.piece_hi; ++i) {
    const ShardPiece& sp = pieces_[i];
    if (!sp.trainable) continue;
    const float* src = comm_buf_.data() + comm_offs_[i];
    for (int64_t j = 0; j < sp.count; ++j) sp.grad[j] += src[j];
  }
  release(gbuf_[size_t(unit)]);
}

}  // namespace q3vl
