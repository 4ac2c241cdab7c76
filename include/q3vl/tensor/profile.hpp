// The step profiler (run.profile): times every device op, copy and collective of one training step where it is
// dispatched (src/tensor/dev_cpu.cpp's DEV_OP, the Comm implementations), so no call site changes. On CUDA a region
// is a pair of timing events recorded on its Exec's stream, from a pool reused step to step, and read once when the
// step ends (end_step: the one synchronisation the profiler adds, after the step's time is taken); on the CPU op
// layer, the steady clock. Only the thread that began the step records (the offloaded AdamW's pool threads are
// inside the optimizer phase), and only the outermost region (a CPU op built from other ops counts once).
// Off, a region costs one predictable branch where it starts and one where it ends.
#pragma once
#include <atomic>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "q3vl/tensor/dev.hpp"

namespace q3vl::prof {

// What a row is: a compute op, a copy, a collective on its stream (NCCL), the host blocked on a collective
// (Comm::wait), the host blocked on the device (to_host, synchronize on CUDA), a stream waiting for another
// (dev::event_wait on CUDA).
enum class Kind : uint8_t { Op, Copy, Collective, CommWait, HostWait, StreamWait };

// Work a region does, for its rate: FLOPs (GEMMs, attention) or bytes read + written (memory-bound ops).
struct Cost {
  double flops = 0, bytes = 0;
};
inline Cost flop(double flops) { return {flops, 0}; }
inline Cost mem(double bytes) { return {0, bytes}; }

namespace detail {
// Between begin_step and end_step. Atomic (a plain load on x86) because other threads' ops read it too.
inline std::atomic<bool> on{false};
}  // namespace detail
inline bool on() { return detail::on.load(std::memory_order_relaxed); }

// One timed region: begin() (call it only when on()) marks the start on x's stream, the destructor the end.
class Scope {
 public:
  Scope() = default;
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  void begin(const dev::Exec& x, const char* name, Cost c, Kind k = Kind::Op);
  ~Scope() {
    if (rec_ >= 0) [[unlikely]] end();
  }

 private:
  void end();
  int rec_ = -1;
};

// A name that lives as long as the process (collectives' names are built at run time).
const char* intern(const std::string& name);

// One line of the table: an op (or collective, or wait) by name, with " [other stream]" when it ran on a stream other
// than the compute stream. tflops / gbps are 0 where the op has no FLOP or byte count. idle: how long the compute
// stream (CPU: the op layer) sat idle just before this row's calls, after the region before them ended: the host
// late to enqueue them (launch work, host-side bookkeeping, a sync just before), where ms is the device's own time
// plus whatever lateness fell inside the region.
struct Row {
  std::string name, kind;
  int64_t calls = 0;
  double ms = 0, pct = 0, tflops = 0, gbps = 0, idle = 0;
};
struct PhaseTime {
  std::string name;
  double ms = 0, pct = 0;
};
struct Report {
  int64_t step = 0;
  std::string device;            // "cuda" or "cpu"
  double step_ms = 0;
  std::vector<PhaseTime> phases;  // the step's phases, then "host / unaccounted": they add up to step_ms
  std::vector<Row> rows;          // by time, the first `top`, then "other (N rows)"
  int64_t regions = 0;            // timed regions in all
  double busy_ms = 0;             // ops and copies on the compute stream (CPU: the op layer's time)
  double exposed_comm_ms = 0;     // compute stream waiting on the communication stream, plus host waits on collectives
  std::vector<std::string> table() const;  // the log's table, a line each
  nlohmann::json json() const;    // metrics.jsonl's "profile" object
};

// Start recording on this thread; `compute` is the step's compute Exec (its stream is "the compute stream").
// shapes: the linears', norms' and attention's rows carry their shape (shaped, shaped_attn), so that each projection gets a
// row of its own (serve's profile; training's with run.profile_shapes).
void begin_step(const dev::Exec& compute, bool shapes = false);
// A linear's row name: `op` alone, or with shapes on "op NxIN->OUT" (interned).
const char* shaped(const char* op, int64_t n, int64_t in, int64_t out);
// A batch of `count` linears of one shape (linear_fwd_batched, linear_bwd_batched): "op NxIN->OUT xCOUNT".
const char* shaped(const char* op, int64_t n, int64_t in, int64_t out, int64_t count);
// Attention's rows the same way: "op NSEGxMAX_LEN hdHD[ causal]".
const char* shaped_attn(const char* op, int64_t nseg, int64_t max_len, int64_t hd, bool causal);
// Stop recording, read the events (CUDA: waits for them) and sum the regions by name. phases: (name, seconds) of
// the step's phases, step_s its time; what the phases leave is the "host / unaccounted" phase.
Report end_step(int64_t step, double step_s, const std::vector<std::pair<std::string, double>>& phases,
                size_t top = 25);
// The event pool back to the device (end of a run).
void release();

}  // namespace q3vl::prof
