// ZeRO data parallelism over the ParamTable's units (DESIGN.md "Training data flow").
//
// Each unit's flat buffer is padded to a multiple of the shard group size; rank r owns the contiguous slice
// [r*s, (r+1)*s) of it (s = padded/size): fp32 master weights, and for trainable parameters the AdamW moments
// and a gradient accumulator. The stages differ in what is sharded:
//   1: optimizer state (grads accumulate in a full buffer, reduce-scattered once per step);
//   2: + gradients (each micro-step's grads are reduce-scattered into the shard accumulator);
//   3: + parameters and gradients in use: the Model keeps no full storage; through its unit hooks the engine
//      gathers each unit into a pool buffer just before it is used (prefetching the next unit of the recorded
//      order while this one computes), frees it right after, and reduce-scatters each unit's gradients as soon
//      as its last backward use completes (zero_stream.cpp). Stages 1/2 keep the full weights in the Model.
//
// Every rank makes the same collectives in the same order although ranks use different units (a micro-batch
// without images skips the vision tower; an empty one skips everything): each pass walks Model::unit_order()
// and a unit the Model did not use is still gathered (and its zero gradients reduce-scattered) when the pass
// moves past it. Gathers and reduce-scatters go over two duplicates of the shard communicator, so that
// each has one fixed order (gathers: the pass order; reduce-scatters: the order of each unit's last use).
//
// Expert parallelism (parallel/expert.hpp): each MoE layer's experts are a unit of their own holding only this
// rank's experts; it is sharded over the ranks that hold the same experts (ExpertParallel::replicas()), not over
// the shard group, and its gradients (already scaled per source rank by the MoE block) are reduced over them only.
//
// Hybrid sharding: the shard group is one node and `replica` joins the ranks holding the same shard on other
// nodes; gradient shards are all-reduced over it once per step.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/model/hooks.hpp"
#include "q3vl/model/qwen3vl.hpp"
#include "q3vl/parallel/expert.hpp"
#include "q3vl/runtime/comm.hpp"

namespace q3vl {

// The intersection of this rank's shard with one tensor: elements [begin, begin+count) of the tensor's
// row-major flattening. Pointers address `count` elements; exp_avg/exp_avg_sq/grad are null when frozen.
struct ShardPiece {
  int param = 0;
  int64_t begin = 0, count = 0;
  float* master = nullptr;
  float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  bool trainable = false, no_decay = false;
};

// Bytes this rank holds, by kind.
struct ZeroMemory {
  int64_t master = 0, exp_avg = 0, exp_avg_sq = 0, grads = 0;  // ZeRO state
  int64_t comm = 0;                                              // reduce-scatter landing buffer
  int64_t working = 0;  // full params + grads: the Model's (stages 1/2); stage 3: the unit pool's peak so far
                        // (buffers in use and released ones kept for reuse)
  int64_t pool_bound = 0;  // stage 3: what the unit pool can reach (from the unit sizes and the use order)
  int64_t state() const { return master + exp_avg + exp_avg_sq + grads; }
};

// One unit's shard geometry on one rank (from the parameter table and the group size alone).
struct ZeroUnit {
  int64_t numel = 0, shard = 0;  // real elements, shard size (padded / group size)
  bool experts = false;          // sharded over the expert replicas (gather/reduce over ep_->replicas())
  int64_t lo = 0, count = 0;     // this rank's real range [lo, lo+count) in the unit
  bool trainable = false;        // any trainable parameter in it
  int64_t master_off = 0, comm_off = 0;
  size_t piece_lo = 0, piece_hi = 0;  // its pieces
  std::vector<size_t> counts, displs;
};

// A group that shards units: its size and this rank's place in it.
struct ShardGroup {
  int size = 1, rank = 0;
};

// Everything one rank's engine allocates, sized before anything is: the engine's constructor allocates exactly
// these and the planner (plan/) calls the same function without allocating (DESIGN.md "Size once").
struct ZeroLayout {
  std::vector<ZeroUnit> units;
  std::vector<ShardPiece> pieces;  // pointers null
  struct Offs { int64_t master, comm, opt; };
  std::vector<Offs> offs;          // per piece: offsets in the master, comm and optimizer buffers (opt -1: frozen)
  int64_t master = 0, opt = 0, comm = 0, full_grads = 0;  // elements: master shard, moments/grad shard each,
                                                          // reduce-scatter landing buffer, stage 1's full grads
};
// `experts`: the expert replicas' group (expert parallelism), or null: expert units are sharded like the rest.
ZeroLayout zero_layout(const ParamTable& t, ShardGroup shard, const ShardGroup* experts, int stage,
                       const std::vector<bool>& trainable);

// A layout to size without building anything, by degrees (the tests and start-up checks of expert layouts).
struct ZeroSpec {
  int world = 1, ep = 1, stage = 3;
  bool hybrid = false;
  int node_ranks = 1;  // hybrid: ranks per node (the shard group)
};

class ZeroEngine {
 public:
  // trainable: one flag per table parameter (frozen ones get no optimizer state, no grads and no update).
  // `replica` may be null (no hybrid). Both comms must outlive the engine.
  // `ep` (may be null: every expert local) must be the Model's exchange, made on the shard group = the world.
  ZeroEngine(Model& model, Comm& shard, Comm* replica, int stage, const std::vector<bool>& trainable,
             ExpertParallel* ep = nullptr);
  // ZeRO state and working set per rank for a layout, computed from the table alone (nothing allocated): what
  // memory() reports once built, the stage-3 pool bound aside (0 here). Rank 0's figures (the largest shard).
  static ZeroMemory estimate(const ModelConfig& cfg, const ZeroSpec& l, const std::vector<bool>& trainable);
  // Elements of a unit of `numel` that each rank of an n-rank shard group holds (the last may hold fewer).
  static int64_t shard_size(int64_t numel, int n) { return (numel + n - 1) / n; }
  ~ZeroEngine();
  ZeroEngine(const ZeroEngine&) = delete;
  ZeroEngine& operator=(const ZeroEngine&) = delete;

  int stage() const { return stage_; }
  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  // The shard buffers behind pieces(), at the layout's offsets (Offs::master, Offs::opt): what an offloaded optimizer
  // updates in place (DevZero's HostState).
  float* master_data() { return master_.data(); }
  float* exp_avg_data() { return exp_avg_.data(); }
  float* exp_avg_sq_data() { return exp_avg_sq_.data(); }
  ZeroMemory memory() const;
  // What memory() will say on rank `rank` of a `group_size` shard group, from the table alone (no allocation):
  // the planner's sizing. working: stages 1/2 the Model's full params + grads, stage 3 0 (pool_bound instead).
  // backward_order: Model::unit_order(true).
  // experts: the expert replicas' group under expert parallelism (null: none).
  static ZeroMemory plan(const ParamTable& t, int group_size, int rank, int stage, const std::vector<bool>& trainable,
                         const std::vector<int>& backward_order, const ShardGroup* experts = nullptr);
  // Stage 3's unit pool: at most `params` gathered units and `grads` unit gradient buffers exist at once, none larger
  // than `biggest` elements (stream_bound() = 4 bytes x biggest x (params + grads)). Devices size it per dtype.
  struct PoolSlots { int64_t biggest = 0, params = 0, grads = 0; };
  static PoolSlots pool_slots(const ParamTable& t, const std::vector<int>& backward_order);
  // What one rank would hold without any sharding (same trainable set), for the report and tests.
  ZeroMemory unsharded() const;
  std::string memory_report() const;

  // Master shards <- the model's full weights (identical on every rank: same seed or same files). Stage 3 then
  // releases the model's full storage and installs the unit hooks: from here on the model runs only between
  // before_forward() and after_backward().
  void load_from_model();
  // Start-up without full weights on any rank: each piece's master is filled directly (load_hf_slices,
  // init_random_slices into master_slices()), then shards_filled() does the rest of load_from_model: stage 3
  // releases the model's storage if it has any and installs the hooks; stages 1/2 fill the model's weights at
  // the next gather_params().
  std::vector<ParamSlice> master_slices() const;
  void shards_filled();
  // Model's full weights <- master shards (every unit; the all-gathers are issued together). Stage 3: nothing
  // (units are gathered when used).
  void gather_params();
  // parallel.gather_dtype = bf16: every gather moves the masters rounded to bf16 (half the bytes) and the model
  // computes with those rounded weights; masters, gradients and optimizer state stay fp32. Same on every stage
  // and rank count, so runs still agree with each other. Set before the first gather.
  void set_gather_bf16(bool on) { gather_bf16_ = on; }
  // Bytes this rank received through parameter gathers since construction.
  int64_t gathered_bytes() const { return gathered_bytes_; }

  // One optimizer step's gradient flow:
  //   begin_step();
  //   for each micro-step { before_forward(); forward; before_backward(scale); backward; after_backward(); }
  //   finish_grads(); ... optimizer on pieces() ...; after_update();
  // Every rank makes the same calls (an empty micro-step skips only forward and backward).
  void begin_step();
  void before_forward();
  // This micro-step's gradients count `scale` times. Stages 1/2: waits for the previous micro-step's
  // reduce-scatters (they read the model's gradients) and zeroes them. Stage 3: ends the forward pass.
  void before_backward(double scale);
  // Stage 1: adds the scaled gradients to the full accumulator; stage 2: starts their per-unit reduce-scatters,
  // which overlap the next micro-step's forward; stage 3: ends the backward pass (its reduce-scatters done).
  void after_backward();
  void finish_grads();
  // Sum of squared trainable gradients over the shard group (the global norm's square).
  double grad_norm_sq();
  void after_update();

  // Debug hook (train.debug_nan_step): make this rank's shard gradient non-finite.
  void poison_grads();

 private:
  using Unit = ZeroUnit;
  void wait_reduce();
  Comm& comm(const Unit& u) const { return u.experts ? ep_->replicas() : shard_; }
  // Stage 3's per-unit communicator duplicates.
  Comm& gcomm(const Unit& u) const { return u.experts ? *egather_comm_ : *gather_comm_; }
  Comm& rcomm(const Unit& u) const { return u.experts ? *ereduce_comm_ : *reduce_comm_; }
  void accumulate_comm();  // comm_buf_ -> trainable grad shards

  // Stage 3 unit streaming (zero_stream.cpp).
  struct Hooks final : UnitHooks {
    ZeroEngine& e;
    explicit Hooks(ZeroEngine& e) : e(e) {}
    void before_forward(int u) override { e.use(u); }
    void after_forward(int u) override { e.unuse(u); }
    void before_backward(int u) override { e.use(u); }
    void after_backward(int u) override { e.unuse(u); }
  };
  struct Slot {
    int unit = 0;
    std::vector<float> buf;  // the gathered full parameters while held
    std::vector<float> send, recv;  // bf16 gathers: this rank's rounded shard and the gathered unit, 2 per float
    std::unique_ptr<CommRequest> req;
  };
  void stream_setup();
  int64_t stream_bound() const;
  void begin_pass(bool backward);
  void end_pass();
  void use(int unit);    // advance to the unit's next slot of the pass (running skipped slots) and bind it
  void unuse(int unit);  // unbind and free; in backward a unit's last use completes its gradients
  void enter_slot(size_t k);
  void leave_slot(size_t k);
  void issue_gather(size_t k);
  void issue_ready_reduces();
  void complete_reduce();  // the oldest pending reduce-scatter: wait, accumulate into the shard, free
  void alloc(std::vector<float>& v, int64_t n, bool zero);
  void release(std::vector<float>& v);

  Model& model_;
  Comm& shard_;
  Comm* replica_;
  ExpertParallel* ep_;
  int stage_;
  std::vector<bool> trainable_;
  std::vector<Unit> units_;
  std::vector<ShardPiece> pieces_;
  std::vector<float> master_, exp_avg_, exp_avg_sq_, grads_, comm_buf_, full_grads_;
  std::vector<int64_t> comm_offs_;  // per piece: its offset in comm_buf_
  std::vector<std::pair<Comm*, std::unique_ptr<CommRequest>>> pending_;
  bool gathered_once_ = false;
  bool gather_bf16_ = false;
  int64_t gathered_bytes_ = 0;
  double scale_ = 1.0;

  Hooks hooks_{*this};
  std::unique_ptr<Comm> gather_comm_, reduce_comm_, egather_comm_, ereduce_comm_;
  std::vector<int> order_[2];          // Model::unit_order(false / true)
  std::vector<int> last_use_, rs_order_;  // backward: each unit's last slot; units by it
  bool backward_ = false, in_pass_ = false;
  std::vector<Slot> slots_;
  size_t next_ = 0;                    // next slot of the pass to enter
  std::vector<int> held_;              // per unit: the slot it is bound to, -1 none
  std::vector<std::vector<float>> gbuf_;  // per unit: full gradients between its first and last backward use
  std::vector<char> grads_done_;
  size_t rs_next_ = 0;                 // rs_order_ index of the next reduce-scatter to issue
  std::vector<std::pair<int, std::unique_ptr<CommRequest>>> rs_pending_;
  int64_t pool_bytes_ = 0;                 // unit buffers in use (their sizes)
  std::vector<std::vector<float>> free_;  // released unit buffers, reused by alloc()
  int64_t cache_bytes_ = 0;                 // their capacities
  int64_t held_bytes_ = 0, held_peak_ = 0;  // capacities of all unit buffers, in use and cached
};

}  // namespace q3vl
