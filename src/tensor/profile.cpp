// The step profiler (tensor/profile.hpp).
#include "q3vl/tensor/profile.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

namespace q3vl::prof {

namespace {

struct Rec {
  const char* name;
  Kind kind;
  bool side;  // on a stream other than the compute stream
  Cost cost;
  dev::Exec x;
  int ev = -1;  // CUDA: its events are pool[ev], pool[ev + 1]
  double t0 = 0, ms = 0;
};

struct State {
  std::thread::id owner;  // the thread that records (none: nobody)
  dev::Exec compute;
  std::vector<Rec> recs;
  std::vector<void*> pool;  // timing events, two a CUDA region, reused step to step
  dev::Exec pool_exec;
  size_t next = 0;
  std::set<std::string> names;
  bool shapes = false;
};
State& state() {
  static State s;
  return s;
}
thread_local int depth = 0;  // regions open on this thread (only the outermost records)

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Op: return "op";
    case Kind::Copy: return "copy";
    case Kind::Collective: return "coll";
    case Kind::CommWait: return "wait";
    case Kind::HostWait: return "sync";
    case Kind::StreamWait: return "stream";
  }
  return "?";
}

std::string row_name(const Rec& r) {
  switch (r.kind) {
    case Kind::CommWait: return std::string("host waits: ") + r.name;
    case Kind::HostWait: return std::string("host waits: ") + r.name;
    case Kind::StreamWait:
      return r.side ? "comm stream waits for compute" : "compute stream waits for comm (exposed)";
    default: return std::string(r.name) + (r.side ? " [other stream]" : "");
  }
}

struct Agg {
  Kind kind = Kind::Op;
  int64_t calls = 0;
  double ms = 0, flops = 0, bytes = 0, idle = 0;
};

// The rows by time: the first `top`, then the rest summed as "other (N rows)".
std::vector<Row> rows_of(const std::map<std::string, Agg>& by, double step_ms, size_t top) {
  std::vector<std::pair<std::string, Agg>> v(by.begin(), by.end());
  std::stable_sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  auto pct = [&](double ms) { return step_ms > 0 ? 100 * ms / step_ms : 0.0; };
  std::vector<Row> out;
  for (size_t i = 0; i < v.size() && i < top; ++i) {
    const Agg& a = v[i].second;
    Row r{v[i].first, kind_name(a.kind), a.calls, a.ms, pct(a.ms)};
    r.idle = a.idle;
    const double s = a.ms * 1e-3;
    if (s > 0 && a.flops > 0) r.tflops = a.flops / s / 1e12;
    else if (s > 0 && a.bytes > 0) r.gbps = a.bytes / s / 1e9;
    out.push_back(r);
  }
  if (v.size() > top) {
    const size_t n = v.size() - top;
    Row o{"other (" + std::to_string(n) + (n == 1 ? " row)" : " rows)"), ""};
    for (size_t i = top; i < v.size(); ++i)
      o.calls += v[i].second.calls, o.ms += v[i].second.ms, o.idle += v[i].second.idle;
    o.pct = pct(o.ms);
    out.push_back(o);
  }
  return out;
}

}  // namespace

void Scope::begin(const dev::Exec& x, const char* name, Cost c, Kind k) {
  State& s = state();
  if (depth > 0 || std::this_thread::get_id() != s.owner) return;
  ++depth;
  Rec r{name, k, x.device == Device::CUDA && x.stream != s.compute.stream, c, x};
  if (x.device == Device::CUDA) {
    if (s.next + 2 > s.pool.size()) {
      s.pool_exec = x;
      s.pool.push_back(dev::timing_event_create(x)), s.pool.push_back(dev::timing_event_create(x));
    }
    r.ev = int(s.next), s.next += 2;
    dev::event_record(x, s.pool[size_t(r.ev)]);
  } else {
    r.t0 = now_ms();
  }
  rec_ = int(s.recs.size());
  s.recs.push_back(r);
}

void Scope::end() {
  State& s = state();
  Rec& r = s.recs[size_t(rec_)];
  if (r.ev >= 0) dev::event_record(r.x, s.pool[size_t(r.ev) + 1]);
  else r.ms = now_ms() - r.t0;
  --depth;
}

const char* intern(const std::string& name) { return state().names.insert(name).first->c_str(); }

const char* shaped(const char* op, int64_t n, int64_t in, int64_t out) {
  if (!state().shapes) return op;
  return intern(std::string(op) + " " + std::to_string(n) + "x" + std::to_string(in) + "->" + std::to_string(out));
}

const char* shaped(const char* op, int64_t n, int64_t in, int64_t out, int64_t count) {
  if (!state().shapes) return op;
  return intern(std::string(op) + " " + std::to_string(n) + "x" + std::to_string(in) + "->" + std::to_string(out) +
                " x" + std::to_string(count));
}

const char* shaped_attn(const char* op, int64_t nseg, int64_t max_len, int64_t hd, bool causal) {
  if (!state().shapes) return op;
  return intern(std::string(op) + " " + std::to_string(nseg) + "x" + std::to_string(max_len) + " hd" +
                std::to_string(hd) + (causal ? " causal" : ""));
}

void begin_step(const dev::Exec& compute, bool shapes) {
  State& s = state();
  s.shapes = shapes;
  s.owner = std::this_thread::get_id();
  s.compute = compute;
  s.recs.clear();
  s.next = 0;
  detail::on.store(true, std::memory_order_relaxed);
}

Report end_step(int64_t step, double step_s, const std::vector<std::pair<std::string, double>>& phases, size_t top) {
  State& s = state();
  detail::on.store(false, std::memory_order_relaxed);
  s.owner = {};
  Report rep;
  rep.step = step;
  rep.device = s.compute.device == Device::CUDA ? "cuda" : "cpu";
  rep.step_ms = step_s * 1e3;
  rep.regions = int64_t(s.recs.size());
  auto pct = [&](double ms) { return rep.step_ms > 0 ? 100 * ms / rep.step_ms : 0.0; };
  double acc = 0;
  for (const auto& [name, sec] : phases) rep.phases.push_back({name, sec * 1e3}), acc += sec * 1e3;
  rep.phases.push_back({"host / unaccounted", rep.step_ms - acc});
  for (PhaseTime& p : rep.phases) p.pct = pct(p.ms);
  std::map<std::string, Agg> by;
  const Rec* prev = nullptr;  // the last region on the compute stream (CPU: the op layer)
  for (Rec& r : s.recs) {
    if (r.ev >= 0) r.ms = dev::event_elapsed_ms(r.x, s.pool[size_t(r.ev)], s.pool[size_t(r.ev) + 1]);
    Agg& a = by[row_name(r)];
    a.kind = r.kind, ++a.calls, a.ms += r.ms, a.flops += r.cost.flops, a.bytes += r.cost.bytes;
    // The gap since the compute stream's previous op or copy ended (CUDA: between their events; CPU: the clock):
    // the stream waiting for the host. Host waits are timed by the host's clock and take no part.
    if (!r.side && (r.kind == Kind::Op || r.kind == Kind::Copy)) {
      if (prev && r.ev >= 0 && prev->ev >= 0)
        a.idle += std::max(0.f, dev::event_elapsed_ms(r.x, s.pool[size_t(prev->ev) + 1], s.pool[size_t(r.ev)]));
      else if (prev && r.ev < 0 && prev->ev < 0)
        a.idle += std::max(0.0, r.t0 - (prev->t0 + prev->ms));
      prev = &r;
      rep.busy_ms += r.ms;
    }
    // Exposed: the host waiting for a collective, the compute stream waiting for the communication stream, or a
    // collective on the compute stream itself (expert parallelism's exchange).
    if (r.kind == Kind::CommWait || (!r.side && (r.kind == Kind::StreamWait || r.kind == Kind::Collective)))
      rep.exposed_comm_ms += r.ms;
  }
  rep.rows = rows_of(by, rep.step_ms, top);
  s.recs.clear();
  return rep;
}

void release() {
  State& s = state();
  for (void* e : s.pool) dev::event_destroy(s.pool_exec, e);
  s.pool.clear(), s.next = 0;
}

std::vector<std::string> Report::table() const {
  char buf[256];
  std::vector<std::string> t;
  const double pct_of = step_ms > 0 ? 100 / step_ms : 0;
  std::snprintf(buf, sizeof buf, "profile of step %lld (rank 0, %s): %.3f ms, %lld timed regions", (long long)step,
                device == "cuda" ? "CUDA events" : "CPU op layer, steady clock", step_ms, (long long)regions);
  t.push_back(buf);
  std::snprintf(buf, sizeof buf, "  %-44s %11s %7s", "phase", "ms", "%");
  t.push_back(buf);
  double sum = 0, sum_pct = 0;
  for (const PhaseTime& p : phases) {
    std::snprintf(buf, sizeof buf, "  %-44s %11.3f %7.1f", p.name.c_str(), p.ms, p.pct);
    t.push_back(buf), sum += p.ms, sum_pct += p.pct;
  }
  std::snprintf(buf, sizeof buf, "  %-44s %11.3f %7.1f", "total (the step)", sum, sum_pct);
  t.push_back(buf);
  std::snprintf(buf, sizeof buf, "  %-44s %-6s %7s %11s %7s %9s %9s %9s", "op", "kind", "calls", "ms", "% step",
                "TFLOP/s", "GB/s", "idle ms");
  t.push_back(buf);
  auto rate = [](double v) {
    char b[24];
    if (v > 0) std::snprintf(b, sizeof b, "%9.3f", v);
    else std::snprintf(b, sizeof b, "%9s", "-");
    return std::string(b);
  };
  for (const Row& r : rows) {
    std::snprintf(buf, sizeof buf, "  %-44.44s %-6s %7lld %11.3f %7.1f %s %s %9.3f", r.name.c_str(), r.kind.c_str(),
                  (long long)r.calls, r.ms, r.pct, rate(r.tflops).c_str(), rate(r.gbps).c_str(), r.idle);
    t.push_back(buf);
  }
  std::snprintf(buf, sizeof buf,
                "  %s busy %.3f ms (%.1f%% of the step), idle %.3f ms; exposed communication %.3f ms "
                "(%.1f%%)",
                device == "cuda" ? "compute stream" : "op layer", busy_ms, busy_ms * pct_of, step_ms - busy_ms,
                exposed_comm_ms, exposed_comm_ms * pct_of);
  t.push_back(buf);
  return t;
}

nlohmann::json Report::json() const {
  using nlohmann::json;
  json ph = json::array(), ops = json::array();
  for (const PhaseTime& p : phases) ph.push_back({{"name", p.name}, {"ms", p.ms}, {"pct", p.pct}});
  for (const Row& r : rows) {
    json o = {{"name", r.name}, {"kind", r.kind}, {"calls", r.calls}, {"ms", r.ms}, {"pct", r.pct}, {"idle_ms", r.idle}};
    if (r.tflops > 0) o["tflops"] = r.tflops;
    if (r.gbps > 0) o["gbps"] = r.gbps;
    ops.push_back(o);
  }
  return {{"step", step},        {"device", device},          {"step_ms", step_ms},
          {"regions", regions},  {"busy_ms", busy_ms},        {"exposed_comm_ms", exposed_comm_ms},
          {"phases", ph},        {"ops", ops}};
}

}  // namespace q3vl::prof
