#include "q3vl/parallel/dev_zero.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "q3vl/core/debug.hpp"
#include "q3vl/core/env.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/tensor/dev_host.hpp"
#include "q3vl/tensor/dev_stream.hpp"

namespace q3vl {

namespace {

constexpr int kParamSlots = 3;  // the unit in use, the prefetched next one, an enclosing use (the LM head's two units)

// The largest gathered unit: its shard times its group (the experts' replicas or the shard group).
int64_t slot_elems(const ZeroLayout& L) {
  int64_t m = 0;
  for (const ZeroUnit& u : L.units) m = std::max(m, u.shard * int64_t(u.counts.size()));
  return m;
}

// Stage 3's gradient slots: every unit between its first and last backward use at one point of the order, and one
// whose reduce-scatter is being issued.
int grad_slots(const ParamTable& t) { return int(ZeroShards::pool_slots(t, unit_order(t, true)).grads); }

// The largest shard of a unit (a streamed gather's staging).
int64_t max_shard(const ZeroLayout& L) {
  int64_t m = 0;
  for (const ZeroUnit& u : L.units) m = std::max(m, u.shard);
  return m;
}

// Offloaded: elements a ring slot holds.
int64_t ring_chunk(const ZeroLayout& L, const RingSpec& r) { return std::max<int64_t>(1, std::min(r.chunk, L.master)); }

// Partial offload: the units whose trained elements the host updates (1), the rest on the device: the first units of
// the table holding `ratio` of the model's trained elements (a unit counted where its middle falls). Counted over the
// whole model, not a rank's shard, so that every rank count splits the same elements (N ranks give 1 rank's numbers,
// also with a delayed update, where the split decides which elements are a step behind); every unit is sharded
// evenly, so each rank's part is about `ratio` of its shard.
std::vector<char> host_units(const ParamTable& t, const std::vector<bool>& trainable, const OffloadSpec& off) {
  const std::vector<UnitInfo>& us = t.units();
  std::vector<char> host(us.size(), 1);
  if (!off.optimizer || off.ratio >= 1) return host;
  std::vector<double> n(us.size(), 0.0);
  double total = 0;
  for (size_t u = 0; u < us.size(); ++u) {
    for (int p : us[u].params) n[u] += trainable[size_t(p)] ? double(t.param(p).numel) : 0.0;
    total += n[u];
  }
  double before = 0;
  for (size_t u = 0; u < us.size(); ++u) host[u] = before + n[u] / 2 <= off.ratio * total, before += n[u];
  return host;
}

// The trained elements of a rank's shard in the device's units.
int64_t device_part(const ZeroLayout& L, const std::vector<char>& host) {
  int64_t k = 0;
  for (size_t u = 0; u < L.units.size(); ++u)
    for (size_t i = L.units[u].piece_lo; i < L.units[u].piece_hi && !host[u]; ++i)
      k += L.offs[i].opt >= 0 ? L.pieces[i].count : 0;
  return k;
}

// host: host_units()'s split (partial offload).
DevZeroMemory sizes(const ParamTable& t, const ZeroLayout& L, int group, int stage, DType dt, DType gd,
                    const OffloadSpec& o, bool in_place, const std::vector<char>& host) {
  DevZeroMemory m;
  const bool off = o.optimizer, stream = off && o.params, delayed = off && o.delayed;
  const int64_t d = int64_t(dtype_size(dt)), g = int64_t(dtype_size(gd)), slot = slot_elems(L);
  // Streamed: a staging buffer a slot for the shard copied up, but where it lands in the slot itself (one rank, no
  // conversion).
  const bool staged = stream && (group > 1 || gd != dt);
  const int64_t up = staged ? (stage == 3 ? kParamSlots : 1) * max_shard(L) * g : 0;
  const int64_t staging = gd == dt ? 0 : (stage == 3 ? kParamSlots : 1) * slot * g;
  const int64_t copies = delayed ? 2 : 1;  // delayed: the gradient shard and the parameter copy twice
  if (!in_place) (off ? m.host_master : m.master) = L.master * 4;
  if (!in_place) (off ? m.host_moments : m.moments) = 2 * L.opt * 4;
  const int64_t kept = device_part(L, host);  // partial offload: on the device too
  m.master += kept * 4, m.moments += 2 * kept * 4;
  m.grads = copies * L.comm * 4;
  m.comm = (group > 1 ? L.comm * 4 : 0) + ((gd == DType::F32 && !off) || stream ? 0 : copies * L.master * g);
  m.pool = (stage == 3 ? slot * (kParamSlots * d + grad_slots(t) * 4) : 0) + staging + up;
  if (off) m.host_staging = 2 * int64_t(std::max(1, o.ring.threads)) * ring_chunk(L, o.ring) * (4 + (stream ? 0 : g));
  if (stream && gd != DType::F32) m.host_params = L.master * g;
  return m;
}

}  // namespace

DevZeroMemory DevZero::plan(const ParamTable& t, int group, int stage, const std::vector<bool>& trainable, DType dt,
                            DType gather, const OffloadSpec& off, bool in_place) {
  const ShardGroup experts{group / t.ep().size, 0};
  return sizes(t, zero_layout(t, {group, 0}, t.ep().size > 1 ? &experts : nullptr, stage, trainable), group, stage,
               dt, gather, off, off.optimizer && in_place, host_units(t, trainable, off));
}

DevZero::DevZero(DevModel& m, Comm& shard, Comm* replica, int stage, const std::vector<bool>& trainable,
                 const dev::Exec* comm_ex, DType gather, Comm* experts, const OffloadSpec& off,
                 const HostState* host)
    : model_(m), ex_(m.exec()), shard_(shard), replica_(replica), experts_(experts), stage_(stage), dt_(m.dtype()),
      gd_(gather == DType::BF16 && m.dtype() == DType::F32 ? DType::BF16 : m.dtype()), conv_(gd_ != dt_),
      ordered_(shard.kind() == "nccl"), cx_(comm_ex ? *comm_ex : m.exec()),
      split_(ordered_ && comm_ex && comm_ex->stream != m.exec().stream), off_(off.optimizer),
      borrowed_(off.optimizer && host), stream_(off.optimizer && off.params), delayed_(off.optimizer && off.delayed) {
  const RingSpec& ring = off.ring;
  const ParamTable& t = m.table();
  const int n = shard.size();
  Q3VL_CHECK(t.ep().size == 1 || (experts && experts->size() * t.ep().size == n && !(replica && replica->size() > 1)),
             "DevZero: an expert split needs the experts' replica group (shard group / ep ranks), and no replicas");
  Q3VL_CHECK(!experts || experts->size() == 1 || experts->kind() == shard.kind(),
             "DevZero: the experts' group must move device buffers as the shard group does");
  const ShardGroup eg{experts ? experts->size() : 1, experts ? experts->rank() : 0};
  L_ = zero_layout(t, {n, shard.rank()}, t.ep().size > 1 ? &eg : nullptr, stage, trainable);
  Q3VL_CHECK((stage == 3) == (m.params() == nullptr), "DevZero: the model's hold does not match the ZeRO stage");
  Q3VL_CHECK(!off.params || off.optimizer, "DevZero: parameters on the host need the masters there (the optimizer offloaded)");
  Q3VL_CHECK(!(stream_ && delayed_), "DevZero: a delayed update cannot stream parameters from the masters it changes");
  Q3VL_CHECK(off.ratio > 0 && off.ratio <= 1 && (off.ratio == 1 || !stream_),
             "DevZero: a part of the update on the device needs the parameters there, and a ratio in (0, 1]");
  const std::vector<char> host_part = host_units(t, trainable, off);
  mem_ = sizes(t, L_, n, stage, dt_, gd_, off, borrowed_, host_part);
  auto f32 = [&](int64_t k) {
    float* p = static_cast<float*>(dev::alloc(ex_, size_t(std::max<int64_t>(k, 1)) * 4));
    dev::fill(ex_, p, DType::F32, k, 0.f);
    return p;
  };
  auto pinned = [&](int64_t bytes, void* p) {  // zeroed, or the caller's p pinned in place
    try {
      debug_pin_check(size_t(bytes));
      return p ? (dev::host_register(ex_, p, size_t(bytes)), p) : dev::host_alloc(ex_, size_t(bytes));
    } catch (const Error& e) {
      char mib[32];
      std::snprintf(mib, sizeof mib, "%.1f", double(bytes) / (1 << 20));
      fail(std::string("parallel.offload_optimizer = \"cpu\": pinning ") + mib + " MiB of host memory was refused (" +
           e.what() + "); check `ulimit -l` and the node's free memory (`q3vl plan` sizes it)");
    }
  };
  // Offloaded, the masters and moments are host memory the device never reads, but the masters that parameters on
  // the host are gathered from (pinned, so their copies run asynchronously).
  const dev::Exec cpu{};
  auto opt = [&](int64_t k, float* theirs, bool pin) -> float* {
    if (!off_) return f32(k);
    if (borrowed_ && k == 0) return nullptr;  // the caller's empty shard: nothing to pin or release
    const int64_t bytes = std::max<int64_t>(k, 1) * 4;
    if (pin) return static_cast<float*>(pinned(bytes, theirs));
    return theirs ? theirs : static_cast<float*>(dev::host_alloc(cpu, size_t(bytes)));
  };
  const bool host_copy = stream_ && gd_ != DType::F32;  // hw_: else the gathers read the (pinned) masters
  master_ = opt(L_.master, borrowed_ ? host->master : nullptr, stream_ && !host_copy);
  m_ = opt(L_.opt, borrowed_ ? host->exp_avg : nullptr, false);
  v_ = opt(L_.opt, borrowed_ ? host->exp_avg_sq : nullptr, false);
  gshard_ = f32(L_.comm), gprev_ = delayed_ ? f32(L_.comm) : nullptr;
  land_ = f32(n > 1 ? L_.comm : 0);
  auto wbuf = [&] { return dev::alloc(ex_, size_t(std::max<int64_t>(L_.master, 1)) * dtype_size(gd_)); };
  if ((gd_ != DType::F32 || off_) && !stream_) wcopy_ = wbuf();
  if (delayed_) wnext_ = wbuf();
  if (host_copy) hw_ = pinned(std::max<int64_t>(L_.master, 1) * int64_t(dtype_size(gd_)), nullptr);
  solo_up_ = stream_ && stage == 3 && n == 1;
  if (off_) {
    chunk_ = ring_chunk(L_, ring);
    ux_ = dev::make_exec(ex_.device, 0, ex_.gpu);
    ring_.resize(2 * size_t(std::max(1, ring.threads)));
    for (Ring& r : ring_) {
      r.g = static_cast<float*>(pinned(chunk_ * 4, nullptr));
      r.w = stream_ ? nullptr : pinned(chunk_ * int64_t(dtype_size(gd_)), nullptr);
      r.down = dev::event_create(ex_);
    }
  }
  make_runs(host_part);
  if (ndev_ > 0) dmaster_ = f32(ndev_), dm_ = f32(ndev_), dv_ = f32(ndev_);
  for (int i = 0, k = stream_ && (n > 1 || conv_) ? (stage == 3 ? kParamSlots : 1) : 0; i < k; ++i)
    up_.push_back(dev::alloc(ex_, size_t(std::max<int64_t>(max_shard(L_), 1)) * dtype_size(gd_)));
  slot_elems_ = slot_elems(L_);
  if (conv_ && stage != 3) stg_.push_back(dev::alloc(ex_, size_t(slot_elems_) * dtype_size(gd_)));
  if (split_) ev_c2m_ = dev::event_create(ex_), ev_m2c_ = dev::event_create(ex_);
  const size_t nu = t.units().size();
  reduced_.assign(nu, 0);
  gbase_.resize(nu);
  for (size_t u = 0; u < nu; ++u) {
    gbase_[u] = stage == 3 ? 0 : m.unit_base(int(u));
    Q3VL_CHECK(stage == 3 || gbase_[u] % n == 0, "DevZero: the model's units are not padded to the shard group");
  }
  if (stage != 3) return;
  order_[0] = unit_order(t, false, !m.loss_in_backward());
  order_[1] = unit_order(t, true);
  last_use_.assign(nu, -1);
  for (size_t k = 0; k < order_[1].size(); ++k) last_use_[size_t(order_[1][k])] = int(k);
  for (size_t u = 0; u < nu; ++u) {
    Q3VL_CHECK(last_use_[u] >= 0, "ZeRO-3: unit " + t.units()[u].name + " is not used by backward");
    rs_order_.push_back(int(u));
  }
  std::sort(rs_order_.begin(), rs_order_.end(), [&](int a, int b) { return last_use_[a] < last_use_[b]; });
  auto event = [&] { return split_ || solo_up_ ? dev::event_create(ex_) : nullptr; };
  for (int i = 0; i < kParamSlots; ++i) {
    pslot_.push_back(dev::alloc(ex_, size_t(slot_elems_) * dtype_size(dt_))), pfree_.push_back(i);
    if (conv_) stg_.push_back(dev::alloc(ex_, size_t(slot_elems_) * dtype_size(gd_)));
    ev_ready_.push_back(event()), ev_free_.push_back(event());
  }
  for (int i = 0, g = grad_slots(t); i < g; ++i) {
    gslot_.push_back(static_cast<float*>(dev::alloc(ex_, size_t(slot_elems_) * 4))), gfree_.push_back(i);
    ev_gfree_.push_back(event());
  }
  held_.assign(nu, -1), gbuf_.assign(nu, -1), done_.assign(nu, 0);
  model_.set_hooks(this);
  unit_runs_.assign(nu, {});
  for (size_t i = 0; i < runs_.size(); ++i) unit_runs_[size_t(runs_[i].unit)].push_back(int(i));
  if (ex_.device != Device::CUDA || off_ || env_is("Q3VL_OVERLAP_UPDATE", "0")) return;
  // The default priority, the lowest (the trainer's are the highest); a workspace for the units' sums of squares.
  ox_ = dev::make_exec(ex_.device, kUpdateWs, ex_.gpu);
  // The units with runs in the order the next forward first reads them, then any it does not read.
  std::vector<int> order = order_[0];
  for (size_t u = 0; u < nu; ++u) order.push_back(int(u));
  ev_upd_.assign(nu, nullptr);
  for (int u : order)
    if (!unit_runs_[size_t(u)].empty() && !ev_upd_[size_t(u)]) {  // the LM head, read twice, is updated once
      upd_plan_.push_back(u);
      ev_upd_[size_t(u)] = dev::event_create(ex_);
    }
  ev_upd_go_ = dev::event_create(ex_), ev_upd_end_ = dev::event_create(ex_);
}

DevZero::~DevZero() {
  dev::synchronize(ex_);
  if (ox_.stream) {
    dev::synchronize(ox_);
    for (void* e : ev_upd_) dev::event_destroy(ex_, e);
    dev::event_destroy(ex_, ev_upd_go_), dev::event_destroy(ex_, ev_upd_end_);
    dev::destroy_exec(ox_);
  }
  if (stage_ == 3) model_.set_hooks(nullptr);
  if (usq_) dev::release(ex_, usq_);
  for (void* p : {(void*)gshard_, (void*)gprev_, (void*)land_, wcopy_, wnext_, (void*)dmaster_, (void*)dm_, (void*)dv_})
    if (p) dev::release(ex_, p);
  for (void* p : {(void*)master_, (void*)m_, (void*)v_}) {
    const bool pinned = stream_ && !hw_ && p == master_;  // the rest of the host state is plain memory
    if (!p) continue;
    if (!off_) dev::release(ex_, p);
    else if (!borrowed_) dev::host_release(pinned ? ex_ : dev::Exec{}, p);
    else if (pinned) dev::host_unregister(ex_, p);
  }
  if (hw_) dev::host_release(ex_, hw_);
  if (off_) {
    dev::synchronize(ux_);
    for (Ring& r : ring_) dev::host_release(ex_, r.g), dev::host_release(ex_, r.w), dev::event_destroy(ex_, r.down);
    dev::destroy_exec(ux_);
  }
  dev::synchronize(cx_);
  for (void* p : pslot_) dev::release(ex_, p);
  for (void* p : up_) dev::release(ex_, p);
  for (void* p : stg_) dev::release(ex_, p);
  for (float* p : gslot_) dev::release(ex_, p);
  for (auto* v : {&ev_ready_, &ev_free_, &ev_gfree_})
    for (void* e : *v) dev::event_destroy(ex_, e);
  dev::event_destroy(ex_, ev_c2m_), dev::event_destroy(ex_, ev_m2c_);
}

void* DevZero::wshard(int64_t off) const {
  return wcopy_ ? at(wcopy_, off, gd_) : static_cast<void*>(master_ + off);
}

const void* DevZero::host_params(int64_t off) const {
  return hw_ ? static_cast<const void*>(at(hw_, off, gd_)) : static_cast<const void*>(master_ + off);
}

// Streamed: the unit's shard (gd_) up from the host into the slot's staging.
const void* DevZero::staged(const ZeroUnit& u, size_t slot, const dev::Exec& x) {
  dev::to_device(x, up_[slot], host_params(u.master_off), size_t(u.shard) * dtype_size(gd_));
  return up_[slot];
}

// The copy of the next unit runs on ux_ while the model's stream computes with this one: it waits for the slot's
// last use (ev_free_) and the model's stream waits for it (ev_ready_, enter_slot).
void DevZero::solo_up(const ZeroUnit& u, size_t b) {
  gathered_ += u.shard * int64_t(dtype_size(gd_));
  dev::event_wait(ux_, ev_free_[b]);
  if (conv_) dev::convert(ux_, pslot_[b], dt_, staged(u, b, ux_), gd_, u.shard);
  else dev::to_device(ux_, pslot_[b], host_params(u.master_off), size_t(u.shard) * dtype_size(gd_));
  dev::event_record(ux_, ev_ready_[b]);
}

// Every unit the first time (start-up, after from_host), then the trained runs only: the frozen pieces never change,
// and their fp32 masters may have been released since.
void DevZero::fill_host_params() {
  const dev::Exec cpu{};
  if (!hw_full_)
    for (const ZeroUnit& u : L_.units) dev::convert(cpu, at(hw_, u.master_off, gd_), gd_, master_ + u.master_off, DType::F32, u.shard);
  else
    for (const Run& r : runs_) dev::convert(cpu, at(hw_, r.master, gd_), gd_, master_ + r.master, DType::F32, r.n);
  hw_full_ = true;
}

std::unique_ptr<CommRequest> DevZero::gather_unit(const ZeroUnit& u, void* dst, void* stg, size_t slot) {
  Comm& c = comm(u);
  const int n = c.size();
  await_update(int(&u - L_.units.data()), n == 1 ? ex_ : cx_);
  gathered_ += u.shard * n * int64_t(dtype_size(gd_));
  if (n == 1) {
    if (stream_ && !conv_) {
      dev::to_device(ex_, dst, host_params(u.master_off), size_t(u.shard) * dtype_size(gd_));
      return nullptr;
    }
    const void* src = stream_ ? staged(u, slot, ex_) : wshard(u.master_off);
    dev::convert(ex_, dst, dt_, src, gd_, u.shard);  // a copy unless conv_
    return nullptr;
  }
  const void* src = stream_ ? staged(u, slot, cx_) : wshard(u.master_off);
  auto r = c.iall_gather(src, conv_ ? stg : dst, size_t(u.shard), gd_);
  if (!conv_) return r;
  if (!ordered_) c.wait(std::move(r));  // MPI: the host widens what arrived
  dev::convert(cx_, dst, dt_, stg, gd_, u.shard * n);
  return r;
}

// Host pieces and this layout's pieces are the same list (one zero_layout of the same group).
void DevZero::from_host(const std::vector<ShardPiece>& host) {
  join_update();
  Q3VL_CHECK(host.size() == L_.pieces.size(), "DevZero: the host engine's shard is another layout");
  for (size_t i = 0; i < host.size(); ++i) {
    const ShardPiece& h = host[i];
    Q3VL_CHECK(h.param == L_.pieces[i].param && h.begin == L_.pieces[i].begin && h.count == L_.pieces[i].count,
               "DevZero: the host engine's shard is another layout");
    if (!h.master) continue;  // a frozen piece the host engine released: unchanged since start-up (hw_ holds it)
    const size_t bytes = size_t(h.count) * 4;
    auto put = [&](float* dst, const float* src) {  // borrowed: the same memory
      if (dst != src) off_ ? (void)std::memcpy(dst, src, bytes) : dev::to_device(ex_, dst, src, bytes);
    };
    put(master_ + L_.offs[i].master, h.master);
    if (L_.offs[i].opt >= 0 && h.exp_avg) put(m_ + L_.offs[i].opt, h.exp_avg), put(v_ + L_.offs[i].opt, h.exp_avg_sq);
  }
  for (const Run& r : runs_) {  // partial offload: the device's part from the host's copy
    if (r.dev < 0) continue;
    dev::to_device(ex_, dmaster_ + r.dev, master_ + r.master, size_t(r.n) * 4);
    dev::to_device(ex_, dm_ + r.dev, m_ + r.opt, size_t(r.n) * 4);
    dev::to_device(ex_, dv_ + r.dev, v_ + r.opt, size_t(r.n) * 4);
  }
  gathered_once_ = false;  // every unit changed: the next refresh_params() moves them all
  dev::synchronize(ex_);
}

// Partial offload: the device's part first goes down into the host's masters and moments (the host engine's own
// memory when borrowed), which then hold the whole shard.
void DevZero::to_host(const std::vector<ShardPiece>& host) {
  join_update();
  for (const Run& r : runs_) {
    if (r.dev < 0) continue;
    dev::to_host(ex_, master_ + r.master, dmaster_ + r.dev, size_t(r.n) * 4);
    dev::to_host(ex_, m_ + r.opt, dm_ + r.dev, size_t(r.n) * 4);
    dev::to_host(ex_, v_ + r.opt, dv_ + r.dev, size_t(r.n) * 4);
  }
  for (size_t i = 0; i < host.size(); ++i) {
    const ShardPiece& h = host[i];
    if (!h.master) continue;  // released (see from_host)
    const size_t bytes = size_t(h.count) * 4;
    auto get = [&](float* dst, const float* src) {
      if (dst != src) off_ ? (void)std::memcpy(dst, src, bytes) : dev::to_host(ex_, dst, src, bytes);
    };
    get(h.master, master_ + L_.offs[i].master);
    if (L_.offs[i].opt >= 0 && h.exp_avg) get(h.exp_avg, m_ + L_.offs[i].opt), get(h.exp_avg_sq, v_ + L_.offs[i].opt);
  }
}

void DevZero::settle(Comm& c, std::unique_ptr<CommRequest> r) {
  if (ordered_) inflight_.emplace_back(&c, std::move(r));
  else c.wait(std::move(r));
}

void DevZero::drain() {
  for (auto& [c, r] : inflight_) c->wait(std::move(r));
  inflight_.clear();
}

void DevZero::c2m() {
  if (!split_) return;
  dev::event_record(ex_, ev_c2m_);
  dev::event_wait(cx_, ev_c2m_);
}

void DevZero::m2c() {
  if (!split_) return;
  dev::event_record(cx_, ev_m2c_);
  dev::event_wait(ex_, ev_m2c_);
}

void DevZero::make_runs(const std::vector<char>& host) {
  for (size_t u = 0; u < L_.units.size(); ++u)
    for (size_t i = L_.units[u].piece_lo; i < L_.units[u].piece_hi; ++i) {
      const ShardPiece& p = L_.pieces[i];
      if (!p.trainable) continue;
      const ZeroLayout::Offs& o = L_.offs[i];
      Run* b = runs_.empty() ? nullptr : &runs_.back();
      const int64_t dev = host[u] ? -1 : ndev_;  // partial offload: the device's part, compacted
      if (b && b->unit == int(u) && b->master + b->n == o.master && b->grad + b->n == o.comm &&
          b->opt + b->n == o.opt && b->no_decay == p.no_decay && (b->dev < 0) == (dev < 0))
        b->n += p.count;
      else
        runs_.push_back({o.master, o.comm, o.opt, p.count, p.no_decay, dev, int(u)});
      if (dev >= 0) ndev_ += p.count;
    }
}

void* DevZero::param_copy(const Run& r) const {
  return wcopy_ && (!off_ || r.dev >= 0) ? at(wcopy_, r.master, gd_) : nullptr;
}

void DevZero::update_runs(const RunFn& fn) {
  if (!ox_.stream) {
    for (const Run& r : runs_) fn(r, ex_, nullptr);
    return;
  }
  join_update();  // the last one (a step without a forward since, as after a skipped step's eval)
  dev::event_record(ex_, ev_upd_go_);  // the gradients final, the norm taken
  dev::event_wait(ox_, ev_upd_go_);
  for (int u : upd_plan_) {
    for (int i : unit_runs_[size_t(u)]) fn(runs_[size_t(i)], ox_, nullptr);
    dev::event_record(ox_, ev_upd_[size_t(u)]);
  }
  dev::event_record(ox_, ev_upd_end_);
  upd_live_ = true;
}

void DevZero::enable_unit_update() {
  Q3VL_CHECK(stage_ == 3 && !off_ && !(replica_ && replica_->size() > 1),
             "DevZero: the update in the backward needs stage 3, the optimizer on the device, and no replicas");
  if (usq_) return;
  const size_t nu = unit_runs_.size();
  usq_ = static_cast<double*>(dev::alloc(ex_, nu * 12 + 8));
  ubad_ = reinterpret_cast<int32_t*>(usq_ + nu);
  if (env_is("Q3VL_UPDATE_HOLD", "experts")) {
    const std::string tail = ".mlp.experts";
    const std::vector<int>& o = order_[1];
    for (size_t k = 0; k < o.size(); ++k) {
      const std::string& n = model_.table().units()[size_t(o[k])].name;
      if (n.size() >= tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0) hold_to_ = k + 1;
    }
  }
  if (!ox_.stream || env_is("Q3VL_UPDATE_PRIO", "low")) return;
  dev::synchronize(ox_);
  dev::destroy_exec(ox_);
  ox_ = dev::make_priority_exec(ex_.device, kUpdateWs, ex_.gpu);
}

void DevZero::arm_update(RunFn fn, SqFn sq, bool poison) {
  Q3VL_CHECK(usq_, "DevZero: arm_update() before enable_unit_update()");
  Q3VL_CHECK(!in_pass_, "DevZero: arm_update() inside a pass");
  join_update();  // the model's stream past the last update before this one's sums are zeroed on its stream
  dev::fill(upd_exec(), usq_, DType::F32, int64_t(unit_runs_.size()) * 3, 0.f);
  armed_ = std::move(fn), sqfn_ = std::move(sq), poison_ = poison;
}

// Unit u's gradient shard is final (its last use done, its reduce-scatter enqueued): its squares, then its runs.
void DevZero::update_unit(int u) {
  const std::vector<int>& runs = unit_runs_[size_t(u)];
  if (runs.empty()) return;
  const dev::Exec& x = upd_exec();
  if (ox_.stream) {  // after what wrote the shard: the reduce-scatter's stream, or the model's (in place)
    dev::event_record(split_ && comm(L_.units[size_t(u)]).size() > 1 ? cx_ : ex_, ev_upd_go_);
    dev::event_wait(ox_, ev_upd_go_);
  }
  const bool poisoned = poison_;
  if (poisoned) dev::fill(x, gshard_ + runs_[size_t(runs[0])].grad, DType::F32, 1, NAN), poison_ = false;
  if (sqfn_ && !poisoned) sqfn_(u, x, usq_ + u, ubad_ + u);
  else
    for (int i : runs) dev::sum_squares(x, gshard_ + runs_[size_t(i)].grad, runs_[size_t(i)].n, DType::F32, usq_ + u, ubad_ + u);
  for (int i : runs) armed_(runs_[size_t(i)], x, ubad_ + u);
  if (ox_.stream) dev::event_record(ox_, ev_upd_[size_t(u)]);
}

void DevZero::unit_sums(std::vector<double>* sq, std::vector<int32_t>* bad) {
  Q3VL_CHECK(sums_ready_, "DevZero: unit_sums() without an armed backward pass since the last call");
  sums_ready_ = false;
  const size_t nu = unit_runs_.size();
  sq->resize(nu), bad->resize(nu);
  dev::to_host(upd_exec(), sq->data(), usq_, nu * 8);
  dev::to_host(upd_exec(), bad->data(), ubad_, nu * 4);
}

void DevZero::await_update(int u, const dev::Exec& x) {
  if (upd_live_ && ev_upd_[size_t(u)]) dev::event_wait(x, ev_upd_[size_t(u)]);
}

void DevZero::join_update() {
  if (!upd_live_) return;
  dev::event_wait(ex_, ev_upd_end_);
  upd_live_ = false;
}

void DevZero::publish_device_part() {
  if (!wnext_) return;
  for (const Run& r : runs_)
    if (r.dev >= 0) dev::convert(ex_, at(wnext_, r.master, gd_), gd_, dmaster_ + r.dev, DType::F32, r.n);
}

void DevZero::flip() {
  Q3VL_CHECK(delayed_, "DevZero: only a delayed update double-buffers the gradient shard");
  std::swap(gshard_, gprev_);
}

void DevZero::land() {
  Q3VL_CHECK(delayed_, "DevZero: only a delayed update double-buffers the parameter copy");
  std::swap(wcopy_, wnext_);
}

// The spans split evenly over the pool's threads (one share each: the ring has two slots a thread), or one share
// inline. All copies go on ux_; each thread's own are in its order there, which is all the slots need.
void DevZero::ring_walk(const std::vector<Span>& spans, const float* g, void* w, ThreadPool* pool,
                        const SpanFn& fn) {
  int64_t total = 0;
  for (const Span& p : spans) total += p.n;
  const int k = pool ? pool->size() : 1;
  Q3VL_CHECK(2 * size_t(k) <= ring_.size(), "DevZero: the host update has more threads than the ring has slots");
  auto share = [&](int64_t i0, int64_t i1) {
    dev::bind_thread(ux_);  // a pool thread enqueues on the rank's GPU
    for (int64_t i = i0; i < i1; ++i)
      ring_share(spans, total * i / k, total * (i + 1) / k, &ring_[2 * size_t(i)], g, w, fn);
  };
  if (pool) pool->run(k, share, 1);
  else share(0, 1);
  dev::synchronize(ux_);
}

// Elements [lo, hi) of the spans in chunks of chunk_, the thread's two slots in turn: chunk c + 1's gradients go
// down while chunk c is updated; chunk c's parameters go up before chunk c + 2's gradients come down into its slot,
// so the wait for that copy down also covers the slot's copy up (chunk c's own copy down was waited before chunk c
// was updated).
void DevZero::ring_share(const std::vector<Span>& spans, int64_t lo, int64_t hi, Ring* slots, const float* g,
                         void* w, const SpanFn& fn) {
  const size_t gs = dtype_size(gd_);
  // f(span, a, n, x): elements [a, a+n) of a span within [c0, c1), x their place in the chunk that starts at c0.
  auto each = [&](int64_t c0, int64_t c1, const auto& f) {
    int64_t x = 0;  // elements of the spans before
    for (const Span& p : spans) {
      const int64_t a = std::max(c0, x), b = std::min(c1, x + p.n);
      if (a < b) f(p, a - x, b - a, a - c0);
      if ((x += p.n) >= c1) break;
    }
  };
  auto slot = [&](int64_t c) -> Ring& { return slots[((c - lo) / chunk_) % 2]; };
  auto down = [&](int64_t c) {
    Ring& r = slot(c);
    if (g)
      each(c, std::min(hi, c + chunk_), [&](const Span& p, int64_t a, int64_t n, int64_t x) {
        dev::to_host_async(ux_, r.g + x, g + p.grad + a, size_t(n) * 4);
      });
    dev::event_record(ux_, r.down);
  };
  if (lo < hi) down(lo);
  for (int64_t c = lo; c < hi; c += chunk_) {
    const int64_t e = std::min(hi, c + chunk_);
    if (e < hi) down(e);
    Ring& r = slot(c);
    dev::event_synchronize(ux_, r.down);
    char* rw = static_cast<char*>(r.w);
    each(c, e, [&](const Span& p, int64_t a, int64_t n, int64_t x) {
      fn(p, a, n, r.g + x, rw ? rw + x * int64_t(gs) : hw_ ? at(hw_, p.master + a, gd_) : nullptr);
    });
    if (w && rw)
      each(c, e, [&](const Span& p, int64_t a, int64_t n, int64_t x) {
        dev::to_device(ux_, at(w, p.master + a, gd_), rw + x * int64_t(gs), size_t(n) * gs);
      });
  }
}

// The caller has waited for the step's gradients (the norm read them), so the copies down need no event.
void DevZero::host_update(ThreadPool& pool, const HostFn& fn) {
  Q3VL_CHECK(off_, "DevZero: the host update needs the optimizer offloaded");
  std::vector<Span> spans;
  for (const Run& r : runs_)
    if (r.dev < 0) spans.push_back({r.grad, r.master, r.n, &r});  // partial offload: the host's part
  ring_walk(spans, delayed_ ? gprev_ : gshard_, stream_ ? nullptr : delayed_ ? wnext_ : wcopy_, &pool,
            [&](const Span& p, int64_t a, int64_t n, const float* g, void* w) { fn(*p.run, a, n, g, w); });
}

// Every unit's masters in gd_ (the CPU op layer's rounding) up into w.
void DevZero::upload_all(void* w) {
  std::vector<Span> spans;
  for (const ZeroUnit& u : L_.units) spans.push_back({-1, u.master_off, u.shard, nullptr});
  ring_walk(spans, nullptr, w, nullptr, [&](const Span& p, int64_t a, int64_t n, const float*, void* out) {
    dev::convert(dev::Exec{}, out, gd_, master_ + p.master + a, DType::F32, n);
  });
}

void DevZero::refresh_params(bool copies_written) {
  // Stage 3 after an update on the device that wrote the copies: nothing to do (the next forward's units wait for it).
  if (stage_ == 3 && copies_written && gathered_once_) return;
  join_update();
  if (off_ && !stream_ && !gathered_once_) {  // start-up or a resume: every unit's masters up, into both copies
    upload_all(wcopy_);
    if (wnext_) dev::copy(ex_, wnext_, wcopy_, size_t(L_.master) * dtype_size(gd_));
  } else if (hw_ && !gathered_once_) {  // start-up or a resume: the host copy (the update writes it after)
    fill_host_params();
  } else if (wcopy_ && !off_ && !(copies_written && gathered_once_)) {
    dev::convert(ex_, wcopy_, gd_, master_, DType::F32, L_.master);
  }
  if (stage_ == 3) return (void)(gathered_once_ = true);
  const size_t d = dtype_size(dt_);
  char* full = static_cast<char*>(model_.params());
  c2m();  // the updated masters, and the model's last reads of its weights
  for (size_t i = 0; i < L_.units.size(); ++i) {
    const ZeroUnit& u = L_.units[i];
    if (!u.trainable && gathered_once_) continue;  // the optimizer changed nothing there
    if (auto r = gather_unit(u, full + gbase_[i] * int64_t(d), conv_ ? stg_[0] : nullptr, 0))
      settle(comm(u), std::move(r));
  }
  gathered_once_ = true;
  m2c();
  drain();
}

// The caller has made the communication stream wait for whatever wrote g.
// The step's first gradients of a unit are written, not added to a zeroed shard: the same values (0 + g), without
// the fill, the landing buffer and the add.
void DevZero::reduce_unit(int ui, const float* g) {
  const ZeroUnit& u = L_.units[size_t(ui)];
  Comm& c = comm(u);
  float* shard = gshard_ + u.comm_off;
  const bool first = !reduced_[size_t(ui)];
  reduced_[size_t(ui)] = 1;
  if (c.size() == 1) {
    if (first) dev::copy(ex_, shard, g, size_t(u.shard) * 4);
    else dev::axpy(ex_, 1.f, g, shard, u.shard, DType::F32);
    return;
  }
  float* land = first ? shard : land_ + u.comm_off;
  settle(c, c.ireduce_scatter(g, land, size_t(u.shard), DType::F32, ReduceOp::Sum));
  if (!first) dev::axpy(cx_, 1.f, land, shard, u.shard, DType::F32);
}

// A step without backward passes (none on any rank) reduced nothing: its gradients are zeros.
void DevZero::zero_unreduced() {
  for (size_t i = 0; i < L_.units.size(); ++i)
    if (L_.units[i].trainable && !reduced_[i])
      dev::fill(ex_, gshard_ + L_.units[i].comm_off, DType::F32, L_.units[i].shard, 0.f);
}

void DevZero::begin_step() {
  std::fill(reduced_.begin(), reduced_.end(), 0);  // the shard is written by the step's first reductions
  if (stage_ != 3) model_.zero_grads();
}

void DevZero::after_backward() {
  if (stage_ != 2) return;
  join_update();
  c2m();
  for (size_t i = 0; i < L_.units.size(); ++i)
    if (L_.units[i].trainable) reduce_unit(int(i), model_.grads() + gbase_[i]);
  m2c();
  drain();  // before the next forward reads the loss from the device
  model_.zero_grads();  // after the reduce-scatters read them
}

void DevZero::idle() {
  begin_pass(false), end_pass();
  begin_pass(true), end_pass();
  after_backward();
}

void DevZero::finish_grads() {
  join_update();
  if (stage_ != 1) zero_unreduced();  // stage 1 reduces here, below
  c2m();
  if (stage_ == 1)
    for (size_t i = 0; i < L_.units.size(); ++i)
      if (L_.units[i].trainable) reduce_unit(int(i), model_.grads() + gbase_[i]);
  if (replica_ && replica_->size() > 1 && L_.comm > 0)
    settle(*replica_, replica_->iall_reduce(gshard_, gshard_, size_t(L_.comm), DType::F32, ReduceOp::Sum));
  m2c();
  drain();
}

// ---- Stage 3: the unit stream ------------------------------------------------------------------------------------

void DevZero::begin_pass(bool backward) {
  if (stage_ != 3) return;
  Q3VL_CHECK(!in_pass_, "ZeRO-3: a pass began before the previous one ended");
  in_pass_ = true, backward_ = backward;
  const std::vector<int>& o = order_[backward];
  slots_.clear();
  slots_.resize(o.size());
  for (size_t k = 0; k < o.size(); ++k) slots_[k].unit = o[k];
  next_ = 0;
  if (backward) std::fill(done_.begin(), done_.end(), 0), rs_next_ = 0, join_update();
  c2m();  // the masters' dt copy, and everything before the pass
  if (!slots_.empty()) issue_gather(0);
}

void DevZero::end_pass() {
  if (stage_ != 3) return;
  Q3VL_CHECK(in_pass_, "ZeRO-3: a pass ended that never began");
  const ParamTable& t = model_.table();
  for (size_t u = 0; u < held_.size(); ++u)
    Q3VL_CHECK(held_[u] < 0, "ZeRO-3: unit " + t.units()[u].name + " still in use at the end of a pass");
  while (next_ < slots_.size()) {  // units this rank did not use still take part in every collective
    enter_slot(next_);
    leave_slot(next_++);
  }
  if (backward_) reduce_done(slots_.size());
  if (backward_ && armed_) {
    armed_ = nullptr, sqfn_ = nullptr, sums_ready_ = true;
    if (ox_.stream) dev::event_record(ox_, ev_upd_end_), upd_live_ = true;
  }
  if (backward_) Q3VL_CHECK(rs_next_ == rs_order_.size(), "ZeRO-3: gradients of some unit were never completed");
  else join_update(), drain();  // the forward's loss is read next
  in_pass_ = false;
}

void DevZero::issue_gather(size_t k) {
  Slot& s = slots_[k];
  const ZeroUnit& u = L_.units[size_t(s.unit)];
  Q3VL_CHECK(!pfree_.empty(), "ZeRO-3: the unit pool is exhausted (a bug: more units in use than kParamSlots)");
  s.buf = pfree_.back();
  pfree_.pop_back();
  const size_t b = size_t(s.buf);
  if (in_place(u)) return;  // the slot stays unused: enter_slot binds the shard
  if (split_) dev::event_wait(cx_, ev_free_[b]);  // the slot's last use is done
  if (solo_up_) return solo_up(u, b);
  s.req = gather_unit(u, pslot_[b], conv_ ? stg_[b] : nullptr, b);
  if (split_) dev::event_record(cx_, ev_ready_[b]);
}

void DevZero::use(int unit) {
  Q3VL_CHECK(in_pass_, "ZeRO-3: the model used a unit outside a pass");
  Q3VL_CHECK(held_[size_t(unit)] < 0, "ZeRO-3: unit " + model_.table().units()[size_t(unit)].name + " used twice at once");
  while (next_ < slots_.size() && slots_[next_].unit != unit) {
    enter_slot(next_);
    leave_slot(next_++);
  }
  if (next_ == slots_.size())
    fail("ZeRO-3: unit " + model_.table().units()[size_t(unit)].name +
         " used out of unit_order()'s order (a bug: the order must list every use)");
  enter_slot(next_++);
}

void DevZero::unuse(int unit) {
  Q3VL_CHECK(held_[size_t(unit)] >= 0,
             "ZeRO-3: unit " + model_.table().units()[size_t(unit)].name + " released but not in use");
  leave_slot(size_t(held_[size_t(unit)]));
}

void DevZero::enter_slot(size_t k) {
  Slot& s = slots_[k];
  const size_t u = size_t(s.unit);
  if (s.req) {
    settle(comm(L_.units[u]), std::move(s.req));
    if (split_) dev::event_wait(ex_, ev_ready_[size_t(s.buf)]);
  }
  if (solo_up_) dev::event_wait(ex_, ev_ready_[size_t(s.buf)]);
  if (in_place(L_.units[u])) await_update(int(u), ex_);
  if (backward_ && k >= 2) reduce_done(k - 1);
  if (k + 1 < slots_.size()) issue_gather(k + 1);  // the next unit's gather, ahead of this unit's compute
  const ZeroUnit& z = L_.units[u];
  float* g = nullptr;
  bool fresh = false;
  // In a group of one the shard is the whole unit: the backward accumulates into it directly, not into a pool buffer
  // that reduce_unit then copies (the first micro-batch) or adds (the others) there. At the step's first use its
  // gradients are fresh: the first op to produce each writes it (no zero-fill; the padding, which no op writes, was
  // zeroed when the shard was allocated).
  if (backward_ && z.trainable && comm(z).size() == 1) {
    g = gshard_ + z.comm_off;
    fresh = !reduced_[u];
    reduced_[u] = 1;
  } else if (backward_ && z.trainable) {
    if (gbuf_[u] < 0) {  // backward accumulates into it from its first use to its last
      Q3VL_CHECK(!gfree_.empty(), "ZeRO-3: the gradient pool is exhausted (a bug: pool_slots() sized it)");
      gbuf_[u] = gfree_.back();
      gfree_.pop_back();
      if (split_) dev::event_wait(ex_, ev_gfree_[size_t(gbuf_[u])]);  // its last reduce-scatter has read it
      dev::fill(ex_, gslot_[size_t(gbuf_[u])], DType::F32, z.shard * int64_t(z.counts.size()), 0.f);
    }
    g = gslot_[size_t(gbuf_[u])];
  }
  model_.bind_unit(int(u), in_place(z) ? wshard(z.master_off) : pslot_[size_t(s.buf)], g, fresh);
  held_[u] = int(k);
}

void DevZero::leave_slot(size_t k) {
  Slot& s = slots_[k];
  const size_t u = size_t(s.unit);
  model_.bind_unit(int(u), nullptr, nullptr);
  held_[u] = -1;
  if (split_ || solo_up_) dev::event_record(ex_, ev_free_[size_t(s.buf)]);
  pfree_.push_back(s.buf);  // a later gather into it waits for this unit's compute (stream order, event, or host)
  s.buf = -1;
  if (!backward_ && k + 1 == slots_.size()) drain();  // the forward's loss is read next
  if (backward_ && last_use_[u] == int(k)) done_[u] = 1;  // reduce-scattered when slot k + 2 is entered
}

// Reduce-scatters, in rs_order_, the units whose last backward use is a slot below `upto`. Every rank issues them at
// the same points of the pass (entering slot k: those of slot k - 2, then the gather of slot k + 1; the rest at its
// end), whether the model computed with a unit, nested two uses (the LM head) or only walked past it: collectives on
// one communicator and one stream must come in one order on every rank.
void DevZero::reduce_done(size_t upto) {
  const bool hold = armed_ && upto + 1 < hold_to_;  // entering a slot before hold_to_ (Q3VL_UPDATE_HOLD)
  if (!hold && !held_units_.empty()) {
    if (!told_hold_)
      log_info("the update in the backward: " + std::to_string(held_units_.size()) +
               " units held until the backward passed its experts (Q3VL_UPDATE_HOLD)");
    told_hold_ = true;
    for (int u : held_units_) update_unit(u);
    held_units_.clear();
  }
  bool waited = false;
  while (rs_next_ < rs_order_.size() && size_t(last_use_[size_t(rs_order_[rs_next_])]) < upto) {
    const size_t r = size_t(rs_order_[rs_next_++]);
    Q3VL_CHECK(done_[r], "ZeRO-3: unit " + model_.table().units()[r].name + " reduce-scattered before its last use ended");
    if (gbuf_[r] >= 0) {  // else frozen, or its gradients written in place (a group of one)
      if (!waited && comm(L_.units[r]).size() > 1) c2m(), waited = true;  // its gradients complete on the model's
      reduce_unit(int(r), gslot_[size_t(gbuf_[r])]);
      if (split_) dev::event_record(cx_, ev_gfree_[size_t(gbuf_[r])]);
      gfree_.push_back(gbuf_[r]);
      gbuf_[r] = -1;
    }
    if (armed_ && hold) held_units_.push_back(int(r));
    else if (armed_) update_unit(int(r));
  }
}

}  // namespace q3vl
