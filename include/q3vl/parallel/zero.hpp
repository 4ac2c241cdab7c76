// ZeRO data parallelism over the ParamTable's units (DESIGN.md "Training data flow").
//
// Each unit's flat buffer is padded to a multiple of the shard group size; rank r owns the contiguous slice
// [r*s, (r+1)*s) of it (s = padded/size): fp32 master weights, and for trainable parameters the AdamW moments
// and a gradient accumulator. The stages differ in what is sharded:
//   1: optimizer state (grads accumulate in a full buffer, reduce-scattered once per step);
//   2: + gradients (each micro-step's grads are reduce-scattered into the shard accumulator);
//   3: + parameters at rest (the full weights are re-gathered before every micro-step).
//
// Design choice for the CPU slice: Model runs all units in one forward() call and owns a full-size parameter and
// gradient buffer, so the gathered weights live there (the gather target; no second copy) and cannot be
// released between micro-steps. Stage 3 therefore has stage 3's communication pattern (all units' all-gathers
// issued together and overlapping each other before every forward; per-unit reduce-scatters issued
// nonblocking as soon as backward returns and overlapped with the next micro-step's forward) but not yet its
// memory saving for the working set. Per-unit prefetch and release need a per-unit hook in Model.
//
// Hybrid sharding: the shard group is one node and `replica` joins the ranks holding the same shard on other
// nodes; gradient shards are all-reduced over it once per step.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/model/qwen3vl.hpp"
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
  int64_t working = 0;                                           // Model's gathered params + grads
  int64_t state() const { return master + exp_avg + exp_avg_sq + grads; }
};

class ZeroEngine {
 public:
  // trainable: one flag per table parameter (frozen ones get no optimizer state, no grads and no update).
  // `replica` may be null (no hybrid). Both comms must outlive the engine.
  ZeroEngine(Model& model, Comm& shard, Comm* replica, int stage, const std::vector<bool>& trainable);

  int stage() const { return stage_; }
  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  ZeroMemory memory() const;
  // What one rank would hold without any sharding (same trainable set), for the report and tests.
  ZeroMemory unsharded() const;
  std::string memory_report() const;

  // Master shards <- the model's full weights (identical on every rank: same seed or same files).
  void load_from_model();
  // Model's full weights <- master shards (every unit; the all-gathers are issued together).
  void gather_params();

  // One optimizer step's gradient flow:
  //   begin_step();
  //   for each micro-step { before_forward(); forward; before_backward(); backward; after_backward(scale); }
  //   finish_grads(); ... optimizer on pieces() ...; after_update();
  // Every rank makes the same calls (an empty micro-step skips only forward and backward).
  void begin_step();
  void before_forward();
  // Waits for the previous micro-step's reduce-scatters (they read the model's gradients) and zeroes them.
  void before_backward();
  // Scales this micro-step's gradients by `scale` and adds them to the full accumulator (stage 1) or starts
  // their per-unit reduce-scatters (stage 2/3), which overlap the next micro-step's forward.
  void after_backward(double scale);
  void finish_grads();
  // Sum of squared trainable gradients over the shard group (the global norm's square).
  double grad_norm_sq();
  void after_update();

  // Debug hook (train.debug_nan_step): make this rank's shard gradient non-finite.
  void poison_grads();

 private:
  struct Unit {
    int64_t numel = 0, shard = 0;  // real elements, shard size (padded / group size)
    int64_t lo = 0, count = 0;     // this rank's real range [lo, lo+count) in the unit
    bool trainable = false;        // any trainable parameter in it
    int64_t master_off = 0, comm_off = 0;
    std::vector<size_t> counts, displs;
  };
  void wait_reduce();
  void accumulate_comm();  // comm_buf_ -> trainable grad shards

  Model& model_;
  Comm& shard_;
  Comm* replica_;
  int stage_;
  std::vector<bool> trainable_;
  std::vector<Unit> units_;
  std::vector<ShardPiece> pieces_;
  std::vector<float> master_, exp_avg_, exp_avg_sq_, grads_, comm_buf_, full_grads_;
  std::vector<int64_t> comm_offs_;  // per piece: its offset in comm_buf_
  std::vector<std::unique_ptr<CommRequest>> pending_;
  bool gathered_once_ = false;
};

}  // namespace q3vl
