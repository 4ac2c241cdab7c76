#include "q3vl/parallel/zero.hpp"

#include <sys/mman.h>
#include <unistd.h>

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
    u.shard = ZeroShards::shard_size(ui.numel, n);
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
  return L;
}

ZeroShards::ZeroShards(const ParamTable& t, const Comm& shard, const std::vector<bool>& trainable, ExpertParallel* ep) {
  Q3VL_CHECK(!ep || (ep->size() == t.ep().size && ep->rank() == t.ep().rank),
             "the expert-parallel group is not the table's expert split");
  const ShardGroup experts = ep ? ShardGroup{ep->replicas().size(), ep->replicas().rank()} : ShardGroup{};
  const ZeroLayout L = zero_layout(t, {shard.size(), shard.rank()}, ep ? &experts : nullptr, 3, trainable);
  pieces_ = L.pieces;
  master_.assign(L.master, 0.f);
  exp_avg_.assign(L.opt, 0.f);
  exp_avg_sq_.assign(L.opt, 0.f);
  for (size_t i = 0; i < pieces_.size(); ++i) {
    ShardPiece& sp = pieces_[i];
    sp.master = master_.data() + L.offs[i].master;
    if (sp.trainable) {
      sp.exp_avg = exp_avg_.data() + L.offs[i].opt;
      sp.exp_avg_sq = exp_avg_sq_.data() + L.offs[i].opt;
    }
  }
}

ZeroMemory ZeroShards::memory() const {
  ZeroMemory m;
  m.master = int64_t(master_.size()) * 4 - released_;
  for (const ShardPiece& p : pieces_) m.frozen += p.trainable || !p.master ? 0 : p.count * 4;
  m.exp_avg = int64_t(exp_avg_.size()) * 4;
  m.exp_avg_sq = int64_t(exp_avg_sq_.size()) * 4;
  return m;
}

// The bytes of a zero_layout as memory() reports them.
static ZeroMemory layout_bytes(const ZeroLayout& L) {
  ZeroMemory m;
  m.master = L.master * 4;
  m.exp_avg = m.exp_avg_sq = L.opt * 4;
  for (const ShardPiece& p : L.pieces) m.frozen += p.trainable ? 0 : p.count * 4;
  return m;
}

int64_t ZeroShards::release_frozen() {
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  int64_t bytes = 0;
  for (ShardPiece& p : pieces_) {
    if (p.trainable || !p.master) continue;
    const uintptr_t a = (uintptr_t(p.master) + page - 1) / page * page, b = uintptr_t(p.master + p.count) / page * page;
    if (a < b && madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED) == 0) bytes += int64_t(b - a);
    p.master = nullptr;
    released_ += p.count * 4;  // what memory() reports: the pieces (the pages at their ends may stay)
  }
  return bytes;
}

ZeroMemory ZeroShards::plan(const ParamTable& t, int n, int r, const std::vector<bool>& trainable,
                            const ShardGroup* experts) {
  return layout_bytes(zero_layout(t, {n, r}, experts, 3, trainable));
}

ZeroMemory ZeroShards::estimate(const ModelConfig& cfg, const ZeroSpec& l, const std::vector<bool>& trainable) {
  if (const std::string e = expert_layout_error(cfg, l.world, l.ep); !e.empty()) fail(e);
  const ParamTable t(cfg, {l.ep, 0});  // every EP rank holds as many experts
  const ShardGroup experts{l.world / l.ep, 0};
  return layout_bytes(zero_layout(t, {l.hybrid ? l.node_ranks : l.world, 0}, l.ep > 1 ? &experts : nullptr, l.stage,
                                  trainable));
}

ZeroShards::PoolSlots ZeroShards::pool_slots(const ParamTable& t, const std::vector<int>& o) {
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
  // Parameters: the unit being used, the prefetched next one and an enclosing use (the LM head's two units).
  // Gradients: every unit between its first and last backward use at one point of the order, plus two whose
  // reduce-scatter is in flight.
  s.params = 3;
  s.grads = open_max + 2;
  return s;
}

std::vector<ParamSlice> ZeroShards::master_slices() const {
  std::vector<ParamSlice> out;
  for (const ShardPiece& p : pieces_) out.push_back({p.param, p.begin, p.count, p.master});
  return out;
}

}  // namespace q3vl
