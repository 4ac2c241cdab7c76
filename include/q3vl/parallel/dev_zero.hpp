// ZeRO-1/2/3 of a DevModel's units on device buffers (DESIGN.md "Training data flow"), through a Comm whose
// collectives take this device's pointers: NCCL between GPU ranks, MPI between CPU ranks (the CPU op layer's buffers
// are host memory).
//
// The geometry is zero_layout()'s, so a rank's shard pieces are the host engine's (checkpoints read and write them
// through it): unit u is padded to s * n elements (n the group size, s = ZeroUnit::shard) and rank r owns
// [r*s, (r+1)*s). Here every rank holds, on its device:
//   - the fp32 master shard of every unit [layout.master] and a copy in the compute dtype (what gathers send);
//   - trainable units' fp32 gradient shard and its reduce-scatter landing buffer [layout.comm each];
//   - the AdamW moments of the trainable pieces [layout.opt each] (the trainer's optimizer runs on them).
// Collectives are the even ones (all_gather, reduce_scatter of s elements a rank): NCCL's fast paths.
// Expert parallelism (the model's table holds E/ep experts of each MoE layer): the experts' units are sharded over
// the ranks holding the same experts (`experts`, ExpertParallel::replicas() or NCCL over its ranks), as zero_layout()
// lays them out for the host engine; their gradients are reduce-scattered over that group only. Each element of the
// model is then in exactly one rank's gradient shard, so a norm summed over the world counts it once.
//
// Stages 1/2: the model holds its full weights in the compute dtype and its full fp32 gradients, units padded
// (DevHold). Gathers after every update (trainable units) fill the weights in place; stage 1 reduce-scatters the
// gradients once per step, stage 2 after every micro-step (then zeroes them).
// Stage 3: the model holds nothing. Through its unit hooks each use of a unit is bound to a pool slot that the
// gather filled (the next unit of unit_order() is gathered while this one computes), and each unit's gradients go
// to a zeroed pool buffer from its first backward use to its last, then are reduce-scattered (two slots later, a
// point every rank reaches alike). Every rank walks the whole order, so units a rank did not use (no images: the
// vision tower; a micro-batch without tokens: all) still take part in every collective, in the same order.
//
// Ordering. An MPI Comm completes on the host: a gather is waited when its unit is entered, a reduce-scatter before
// its landing buffer is added. An NCCL Comm runs on a communication stream (`comm_ex`; without one, on the model's
// stream, in order with its kernels): the next unit's gather runs there while this unit computes, a unit's
// reduce-scatter as soon as its last backward use is enqueued, and the streams wait for each other on events only
// (a slot's gather landed, a slot's last use done, a gradient slot read). The host waits for the requests under the
// watchdog before it reads anything from the device (the end of a forward pass: the loss) and at the end of a step,
// so a rank that never arrives is named instead of hanging a stream.
//
// Optimizer offload (parallel.offload_optimizer = "cpu"): the fp32 masters and the AdamW moments live in host memory
// (the caller's, HostState: train passes the host engine's shards, which the update then changes in place, so a
// checkpoint copies nothing and the host holds them once) and the trainer updates them on the host (host_update).
// The gradient shard still accumulates on the device (the norm and the overflow check read it there, as without
// offload), and the masters in the gathers' dtype stay on the device (wcopy_, then always allocated). The update
// streams: chunk by chunk, the gradients come down through a small pinned ring on a copy stream of its own, the
// chunk is updated on the host's threads, its parameters go up through the ring, and the next chunk's copy down runs
// behind this one's update. So the host holds the masters and moments and nothing else the size of the model (8B on
// one 128 GiB host), and no host memory needs pinning but the ring.
//
// Parameters on the host (parallel.offload_params = "frozen", with the optimizer offloaded): no copy of the masters
// stays on the device (no wcopy_). The host holds the parameters in the gathers' dtype (hw_, pinned; the masters
// themselves when that is fp32), and every unit's gather starts with its shard copied up from there: into a staging
// buffer of its pool slot on the stream the gather runs on, or, at one rank, straight into its pool slot on the
// ring's copy stream after the slot's last use, which the model's stream waits for when it enters the unit. The
// prefetch of the next unit hides the copy behind the compute. The host update writes the trained pieces' new
// values into hw_ (no copy up). A LoRA base is nearly all the parameters: hw_ holds it in the compute dtype, and the
// host engine can then release the base's fp32 masters (ZeroShards::release_frozen), which no checkpoint holds.
//
// Delayed update (parallel.offload_update = "delayed", DeepSpeed's delayed parameter update): the device gradient
// shard and the parameter copy are double-buffered, so that step k's update on the host reads one gradient shard and
// writes one parameter copy while step k+1 accumulates into the other shard and gathers from the other copy; flip()
// hands the step's gradients to the update, land() the update's parameters to the next step.
//
// Partial offload (parallel.offload_ratio < 1, DeepSpeed's ZeRO-Offload++ "ratio"): only the units holding the first
// `ratio` of the model's trained elements are updated on the host; the rest keep fp32 masters and moments on the
// device (dmaster_, dm_, dv_, compacted: Run::dev) and are updated there, on the model's stream, while the host
// updates its part, and are written into the parameter copy (both copies when delayed: that part is never stale).
// The host memory is unchanged (the host engine's shards hold everything; to_host() brings the device part down for
// checkpoints); the device holds 12 bytes more for every element kept there. A host whose memory bandwidth cannot
// update the whole shard within a step (a small model's short step) then hides its part under the step.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/core/thread_pool.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/parallel/zero.hpp"

namespace q3vl {

// A DevZero's device bytes by kind (the log's memory lines; the planner's sizing).
struct DevZeroMemory {
  int64_t master = 0, moments = 0, grads = 0, comm = 0;  // fp32 shards; comm: landing + the dt copy of the masters
  int64_t pool = 0;                                       // stage 3: gathered unit slots and gradient slots
  // Optimizer offload: host bytes, not in total(): the fp32 masters, the AdamW moments, and the pinned ring the
  // update's copies go through (the gradient shard down, the masters in the gathers' dtype up).
  // Parameters on the host (stream): their copy in the gathers' dtype (none when that is fp32: the masters).
  int64_t host_master = 0, host_moments = 0, host_staging = 0, host_params = 0;
  int64_t total() const { return master + moments + grads + comm + pool; }  // device bytes
  int64_t host_total() const { return host_master + host_moments + host_staging + host_params; }
};

// The pinned ring an offloaded update's copies go through: two slots of `chunk` elements for each of its `threads`.
struct RingSpec {
  static constexpr int64_t kChunk = int64_t(1) << 20;  // parallel.offload_chunk's default
  int64_t chunk = kChunk;
  int threads = 1;
};

// What a DevZero keeps on the host (parallel.offload_*; see the top).
struct OffloadSpec {
  bool optimizer = false;  // "cpu": the fp32 masters and AdamW moments on the host, AdamW run there
  bool params = false;     // "frozen" (needs optimizer): every gather streams its shard up from the host
  bool delayed = false;    // "delayed" (needs optimizer, not params): the update one step behind
  RingSpec ring;
  double ratio = 1;        // the part of the trained elements updated on the host (needs optimizer, not params)
};

// Host buffers an offloaded DevZero updates in place, at the layout's offsets (Offs::master, Offs::opt).
struct HostState {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

class DevZero final : UnitHooks {
 public:
  // `shard` and `replica` (hybrid sharding; may be null) take the model's device buffers and outlive the engine.
  // comm_ex: the Exec (stream) an NCCL `shard`/`replica` runs on when it is not the model's; null: the model's.
  // gather: the dtype units travel in, the model's by default; BF16 with an fp32 model (parallel.gather_dtype) sends
  // the masters rounded to bf16 and widens them in the pool (half the bytes; the model computes with the rounded
  // weights, as the host engine's bf16 gathers do).
  // experts: the expert replicas' group, needed when the model's table splits its experts (not with a replica).
  // off: what stays on the host (see above); `host` (may be null: allocated here): the caller's masters and moments.
  DevZero(DevModel& m, Comm& shard, Comm* replica, int stage, const std::vector<bool>& trainable,
          const dev::Exec* comm_ex = nullptr, DType gather = DType::F32, Comm* experts = nullptr,
          const OffloadSpec& off = {}, const HostState* host = nullptr);
  ~DevZero() override;
  DevZero(const DevZero&) = delete;
  DevZero& operator=(const DevZero&) = delete;
  // The DevHold a model for this engine needs.
  static DevHold hold(int group, int stage) { return {group, stage != 3}; }
  // What an engine allocates, without allocating: rank 0's (the largest) shard. t.ep(): the expert split (the expert
  // replicas' group is group / t.ep().size ranks). in_place: offloaded onto the caller's HostState (not counted).
  static DevZeroMemory plan(const ParamTable& t, int group, int stage, const std::vector<bool>& trainable, DType dt,
                            DType gather, const OffloadSpec& off = {}, bool in_place = false);
  DevZeroMemory memory() const { return mem_; }

  // Adjacent trainable pieces with the same flags: one optimizer launch each (partial offload: of the same side).
  // A run never spans two units.
  struct Run {
    int64_t master = 0, grad = 0, opt = 0, n = 0;
    bool no_decay = false;
    int64_t dev = -1;  // offloaded with ratio < 1: kept on the device, at this offset of dev_master() and the moments
    int unit = -1;
  };
  const std::vector<Run>& runs() const { return runs_; }
  // The optimizer on the device: fn(run, exec) enqueues run's update on exec, for every run. Overlapped (stage 3,
  // the optimizer on a GPU, not offloaded; Q3VL_OVERLAP_UPDATE=0 turns it off for A/B runs): on a stream of its
  // own, below the model's in priority, after the model's work so far, the units in the order the next forward uses
  // them. That forward then runs beside it: the model's stream waits for a unit's update only where a pass first
  // reads the unit (its gather, or binding it in place), and for all of it at the end of the forward and before
  // anything else reads the shards (join_update). The same kernels on the same data, in another order: no element
  // changes. Otherwise every run on the model's stream, in order.
  // skip: null here; see arm_update.
  using RunFn = std::function<void(const Run& r, const dev::Exec& x, const int32_t* skip)>;
  void update_runs(const RunFn& fn);
  // The update in the backward (optim.update_in_backward; stage 3, the optimizer on the device, no replicas): each
  // trained unit updated as soon as the step's last backward pass has made its gradient shard final, instead of
  // after the whole gradient's norm. enable_unit_update() once: each unit's sum of squares and non-finite count on
  // the device (and, on a GPU, the update's stream at the model's priority: it runs beside the backward's GEMMs, and
  // the step ends with it; Q3VL_UPDATE_PRIO=low keeps it below them). arm_update(fn) before the step's last
  // micro-step: in its backward pass each unit, after its last use (and its reduce-scatter), has its shard's
  // squares summed and non-finite elements counted (sq(unit, exec, sum, bad) adds them; null: every run read), then
  // fn(run, exec, skip) for its runs, skip pointing at that count: a unit whose gradient is not finite keeps its
  // parameters and moments. poison: the first trained unit's gradient gets a NaN first (train.debug_nan_step; that
  // unit's runs are read whatever sq). On the update's stream (the next forward waits unit by unit, as
  // update_runs'), or in order on the model's. Q3VL_UPDATE_HOLD=experts (an A/B knob): the units completed while the
  // backward still has expert units ahead (`*.mlp.experts`, whose grouped weight-gradient GEMMs are bound by HBM, as
  // the update is) wait, in order, until it has passed the last of them; then the update shares the GPU with the
  // backward's attention, dense GEMMs and vision tower instead. The same updates on the same gradients: no element
  // changes.
  using SqFn = std::function<void(int u, const dev::Exec& x, double* sum, int32_t* bad)>;
  void enable_unit_update();
  void arm_update(RunFn fn, SqFn sq = nullptr, bool poison = false);
  const std::vector<int>& unit_runs(int u) const { return unit_runs_[size_t(u)]; }  // indices into runs()
  // The armed pass's results (waits for them): each unit's sum of squares and non-finite count, in unit order.
  void unit_sums(std::vector<double>* sq, std::vector<int32_t>* bad);

  int stage() const { return stage_; }
  const ZeroLayout& layout() const { return L_; }
  bool offloaded() const { return off_; }
  // Whether a gradient the model writes into the shard in place (stage 3, a unit in a group of one) is final as
  // written: no replica sum (hybrid sharding) changes it before the norm reads it.
  bool in_place_grads_final() const { return stage_ == 3 && !(replica_ && replica_->size() > 1); }
  float* master() { return master_; }  // offloaded: host memory, as the moments
  float* grads() { return gshard_; }   // at ZeroLayout::Offs::comm (device)
  float* exp_avg() { return m_; }      // at ZeroLayout::Offs::opt
  float* exp_avg_sq() { return v_; }
  // Partial offload: the runs with Run::dev >= 0 (device memory, at Run::dev; null when none).
  int64_t device_elems() const { return ndev_; }
  float* dev_master() { return dmaster_; }
  float* dev_exp_avg() { return dm_; }
  float* dev_exp_avg_sq() { return dv_; }
  // Where an update on the device writes run r's new parameters in gather_dtype() in the pass that updates its
  // masters (dev::adamw's copy): the run's place in the copy the gathers read, element for element the masters'.
  // Null where there is no copy (fp32 gathers read the masters) or the host updates the run (offloaded, Run::dev < 0).
  void* param_copy(const Run& r) const;
  // Partial offload, after the model's stream updated dev_master() and the copy through param_copy(): delayed, its
  // values into the other parameter copy too (in the gathers' dtype, on that stream), so neither is stale.
  void publish_device_part();
  DType gather_dtype() const { return gd_; }
  bool parameters_on_host() const { return stream_; }
  // Parameters on the host in a dtype other than fp32: gathers never read the fp32 masters after refresh_params(),
  // nor the frozen pieces' ever again (their host masters may be released).
  bool host_param_copy() const { return hw_ != nullptr; }

  // Offloaded: the update on the host. fn(run, a, n, g, w) for every range [a, a+n) of every run, on the pool's
  // threads (as many as the ring's): g holds the range's gradients (host memory), and fn writes the range's new
  // masters in gather_dtype() to w (parameters on the host: into their host copy; null when that is the fp32
  // masters themselves). Each thread walks its own share of the runs in chunks through its own two ring slots, each chunk's
  // copy down behind the update of the one before, its parameters up after it: no thread waits for another.
  // Reads the gradient shard and writes the parameter copy the next step gathers; delayed: flip()'s and land()'s
  // other buffers. Any thread (the device is made the calling thread's current one).
  using HostFn = std::function<void(const Run& r, int64_t a, int64_t n, const float* g, void* w)>;
  void host_update(ThreadPool& pool, const HostFn& fn);
  // Delayed: the step's gradient shard becomes the update's, and the next step accumulates into the other one.
  void flip();
  // Delayed: the landed update's parameter copy becomes what the next step gathers (then refresh_params()).
  void land();

  // Master shards and moments from (to) the host engine's pieces of the same layout: start-up, resume, checkpoints.
  void from_host(const std::vector<ShardPiece>& host);
  void to_host(const std::vector<ShardPiece>& host);  // not const: joins an overlapped update first
  // After the masters changed (start-up, a resume, every update on the device): the dt copy (offloaded: after
  // from_host, every unit's, both copies when delayed; an offloaded update writes it itself), and stages 1/2 the
  // model's weights. copies_written: the update on the device wrote every run's copy itself (param_copy); the frozen
  // pieces' copy never changes, so the copy is converted whole only at the first refresh (start-up, from_host).
  void refresh_params(bool copies_written = false);

  // One optimizer step: begin_step(); per micro-step { forward pass; backward pass; after_backward() } (a rank with
  // no tokens runs the passes without compute: idle()); finish_grads(); optimizer on the shards; refresh_params().
  void begin_step();
  void begin_pass(bool backward);
  void end_pass();
  void after_backward();
  void idle();
  void finish_grads();
  // Collectives so far that moved parameters, in bytes received by this rank.
  int64_t gathered_bytes() const { return gathered_; }

 private:
  struct Slot {
    int unit = -1;
    int buf = -1;  // index into pslot_
    std::unique_ptr<CommRequest> req;
  };
  void before_forward(int u) override { use(u); }
  void after_forward(int u) override { unuse(u); }
  void before_backward(int u) override { use(u); }
  void after_backward(int u) override { unuse(u); }
  void use(int u);
  void unuse(int u);
  void enter_slot(size_t k);
  void leave_slot(size_t k);
  void issue_gather(size_t k);
  void reduce_done(size_t upto);
  // Reduce-scatters unit u's full gradients at `g` (padded) into its shard: through the landing buffer, added; the
  // step's first land in the shard itself (one rank: copied), which begin_step does not zero.
  void reduce_unit(int u, const float* g);
  void zero_unreduced();  // the trainable units' shards that no reduce_unit wrote this step: zeroed
  // Offloaded: walks `spans` (device gradient offset or -1, master offset, count), split over the pool's threads (or
  // inline), each share in chunks through the thread's ring slots: the chunk's gradients down (if g), fn over its
  // spans, its parameters up into w (if not null).
  struct Span { int64_t grad, master, n; const Run* run; };
  struct Ring { float* g; void* w; void* down; };  // a pinned slot; its chunk's copy down done
  using SpanFn = std::function<void(const Span& p, int64_t a, int64_t n, const float* g, void* w)>;
  void ring_walk(const std::vector<Span>& spans, const float* g, void* w, ThreadPool* pool, const SpanFn& fn);
  void ring_share(const std::vector<Span>& spans, int64_t lo, int64_t hi, Ring* slots, const float* g, void* w,
                  const SpanFn& fn);
  void make_runs(const std::vector<char>& host);  // host[unit] 0: the unit's runs are the device's part (Run::dev)
  void upload_all(void* w);  // offloaded: every unit's masters in gd_ up into the copy w
  void await_update(int u, const dev::Exec& x);  // x waits for unit u's part of an overlapped update
  void join_update();  // the model's stream waits for all of it (nothing if none is in flight)
  void settle(Comm& c, std::unique_ptr<CommRequest> r);  // MPI: wait now; NCCL: later (drain)
  void drain();  // the host waits for every request in flight (under the watchdog)
  void c2m();    // the communication stream waits for the work enqueued on the model's so far
  void m2c();    // and the other way round
  void* wshard(int64_t off) const;
  Comm& comm(const ZeroUnit& u) const { return u.experts ? *experts_ : shard_; }  // the unit's shard group
  // Stage 3 where unit u's gather would be a plain copy of its whole shard (a group of one, the shard in dt on the
  // device, the update on the model's stream): the model computes with wshard itself, gathering nothing.
  bool in_place(const ZeroUnit& u) const { return comm(u).size() == 1 && !conv_ && !stream_ && !off_; }
  // Unit u (its shard at wshard) gathered in full into dst (dt), through staging buffer `stg` when conv_; on the
  // communication stream (NCCL), or waited (MPI), or a copy (one rank). MPI's widening waits for the request.
  // Streamed: the shard is copied up from the host first (into slot `slot`'s staging unless it can land in dst).
  std::unique_ptr<CommRequest> gather_unit(const ZeroUnit& u, void* dst, void* stg, size_t slot);
  const void* staged(const ZeroUnit& u, size_t slot, const dev::Exec& x);
  void solo_up(const ZeroUnit& u, size_t b);  // one rank, streamed: pool slot b filled on ux_ (see the top)
  const void* host_params(int64_t off) const;  // streamed: the host parameters at master offset off, in gd_
  void fill_host_params();  // streamed: hw_ from the masters (all units once, then the trained runs)

  DevModel& model_;
  const dev::Exec ex_;
  Comm& shard_;
  Comm* replica_;
  Comm* experts_;
  int stage_;
  DType dt_, gd_;  // compute; what gathers send
  bool conv_;      // gd_ is not dt_: gathers land in staging (stg_) and are widened
  bool ordered_;  // collectives run on a stream (NCCL), not on the host
  dev::Exec cx_;  // the communication stream's Exec (the model's when there is none of its own)
  bool split_;    // cx_ is not the model's: events order the two
  void *ev_c2m_ = nullptr, *ev_m2c_ = nullptr;
  std::vector<void*> ev_ready_, ev_free_, ev_gfree_;  // per pool slot: gather landed, last use done; grad slot read
  ZeroLayout L_;
  std::vector<int64_t> gbase_;  // [unit] its first element of the full padded gradients (stages 1/2: the model's)
  float *master_ = nullptr, *gshard_ = nullptr, *land_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  void* wcopy_ = nullptr;  // masters in dt (null: dt is fp32, the masters themselves; offloaded: always, on the device)
  bool off_ = false;
  bool borrowed_ = false;    // offload: master_, m_, v_ are the caller's (pinned here, not allocated)
  bool stream_ = false;      // parameters on the host: gathers start from host_params()
  void* hw_ = nullptr;       // streamed, gd_ not fp32: the parameters in gd_ on the host (pinned)
  bool hw_full_ = false;     // hw_ holds every unit (later fills: the trained runs only)
  bool solo_up_ = false;     // streamed at stage 3 on one rank: copies up on ux_ (solo_up)
  std::vector<void*> up_;    // streamed: per pool slot (stage 3) or one, the shard up in gd_ (none if solo_up_ && !conv_)
  bool delayed_ = false;     // offload: gprev_ and wnext_ exist
  float *dmaster_ = nullptr, *dm_ = nullptr, *dv_ = nullptr;  // partial offload: the device's part (Run::dev)
  int64_t ndev_ = 0;         // its elements
  float* gprev_ = nullptr;   // delayed: the gradient shard the update in flight reads
  void* wnext_ = nullptr;    // delayed: the parameter copy it writes
  std::vector<Run> runs_;
  dev::Exec ux_;             // offloaded: the ring's copy stream
  std::vector<Ring> ring_;   // two slots a thread
  int64_t chunk_ = 0;        // elements a ring slot holds
  std::vector<char> reduced_;  // [unit] its gradient shard holds gradients of this step
  DevZeroMemory mem_;
  int64_t gathered_ = 0;
  bool gathered_once_ = false;
  std::vector<std::pair<Comm*, std::unique_ptr<CommRequest>>> inflight_;
  // Stage 3.
  int64_t slot_elems_ = 0;
  std::vector<void*> pslot_, stg_;  // stg_: per pool slot (stage 3) or one (stages 1/2), in gd_ (conv_ only)
  std::vector<float*> gslot_;
  std::vector<int> pfree_, gfree_;
  std::vector<int> order_[2], last_use_, rs_order_;
  std::vector<Slot> slots_;
  size_t next_ = 0, rs_next_ = 0;
  bool backward_ = false, in_pass_ = false;
  std::vector<int> held_, gbuf_;  // [unit] its slot, its gradient slot (-1: none)
  std::vector<char> done_;
  // The overlapped update (update_runs).
  dev::Exec ox_;                     // its stream (null: not overlapped)
  static constexpr size_t kUpdateWs = 64 << 10;  // ox_'s workspace: sum_squares' partial sums
  std::vector<int> upd_plan_;        // the units with runs, in the order the next forward first reads them
  std::vector<void*> ev_upd_;        // [unit] its runs updated (null: no runs)
  void *ev_upd_go_ = nullptr, *ev_upd_end_ = nullptr;  // the model's work before it; all of it
  bool upd_live_ = false;            // in flight: the model's stream has not waited for all of it
  // The update in the backward (enable_unit_update).
  std::vector<std::vector<int>> unit_runs_;  // [unit] its runs (indices into runs_)
  double* usq_ = nullptr;                    // [unit] sum of squares, then [unit] int32 non-finite counts
  int32_t* ubad_ = nullptr;
  RunFn armed_;                              // set: the next backward pass updates each unit as it completes
  SqFn sqfn_;
  bool poison_ = false;
  bool sums_ready_ = false;                  // an armed pass ended since the last unit_sums()
  size_t hold_to_ = 0;  // Q3VL_UPDATE_HOLD=experts: the backward's first slot past its last expert unit (0: no hold)
  std::vector<int> held_units_;              // completed units whose updates wait for slot hold_to_
  bool told_hold_ = false;
  void update_unit(int u);
  const dev::Exec& upd_exec() const { return ox_.stream ? ox_ : ex_; }  // the update's stream, or the model's
};

}  // namespace q3vl
