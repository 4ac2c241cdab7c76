// ZeRO's layout over the ParamTable's units (DESIGN.md "Training data flow") and the host copy of one rank's shards.
//
// Each unit's flat buffer is padded to a multiple of the shard group size; rank r owns the contiguous slice
// [r*s, (r+1)*s) of it (s = padded/size): fp32 master weights, and for trainable parameters the AdamW moments
// and a gradient accumulator. The device trainer's ZeRO (parallel/dev_zero.hpp) gathers, reduce-scatters and
// updates over this layout; ZeroShards holds the same shards on the host, where train's start-up reads or draws
// them, checkpoints are written from and read into them, and an offloaded optimizer updates them in place.
//
// Expert parallelism (parallel/expert.hpp): each MoE layer's experts are a unit of their own holding only this
// rank's experts; it is sharded over the ranks that hold the same experts (ExpertParallel::replicas()), not over
// the shard group.
//
// Hybrid sharding: the shard group is one node; the ranks holding the same shard on other nodes hold copies.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/model/params.hpp"
#include "q3vl/model/weights.hpp"
#include "q3vl/parallel/expert.hpp"
#include "q3vl/runtime/comm.hpp"

namespace q3vl {

// The intersection of this rank's shard with one tensor: elements [begin, begin+count) of the tensor's
// row-major flattening. Pointers address `count` elements; exp_avg/exp_avg_sq are null when frozen.
struct ShardPiece {
  int param = 0;
  int64_t begin = 0, count = 0;
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  bool trainable = false, no_decay = false;
};

// Host bytes a rank's ZeroShards hold, by kind (the gradients live on the device: DevZero).
struct ZeroMemory {
  int64_t master = 0, exp_avg = 0, exp_avg_sq = 0;
  int64_t frozen = 0;  // of master: the frozen pieces' (ZeroShards::release_frozen can give them back)
  int64_t state() const { return master + exp_avg + exp_avg_sq; }
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
  int64_t master = 0, opt = 0, comm = 0;  // elements: master shard, moments each, gradient shard (and its
                                          // reduce-scatter landing buffer)
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

// One rank's ZeRO shards on the host (the stage-3 layout), sized by zero_layout(): the fp32 masters and the AdamW
// moments, what checkpoints read and write; no gradients (those stay on the device, DevZero's).
class ZeroShards {
 public:
  // trainable: one flag per table parameter (frozen ones get no optimizer state).
  // `shard`: the shard group (its size and this rank's place). `ep` (may be null: every expert local) must be the
  // table's expert split; its replicas shard the expert units.
  ZeroShards(const ParamTable& t, const Comm& shard, const std::vector<bool>& trainable, ExpertParallel* ep = nullptr);
  // ZeRO state per rank for a layout, computed from the table alone (nothing allocated). Rank 0's figures (the
  // largest shard).
  static ZeroMemory estimate(const ModelConfig& cfg, const ZeroSpec& l, const std::vector<bool>& trainable);
  // Elements of a unit of `numel` that each rank of an n-rank shard group holds (the last may hold fewer).
  static int64_t shard_size(int64_t numel, int n) { return (numel + n - 1) / n; }
  // What memory() will say on rank `rank` of a `group_size` shard group, from the table alone (no allocation):
  // the planner's sizing. experts: the expert replicas' group under expert parallelism (null: none).
  static ZeroMemory plan(const ParamTable& t, int group_size, int rank, const std::vector<bool>& trainable,
                         const ShardGroup* experts = nullptr);
  // The device ZeRO-3's unit pool: at most `params` gathered units and `grads` unit gradient buffers exist at once,
  // none larger than `biggest` elements. backward_order: unit_order(t, true).
  struct PoolSlots { int64_t biggest = 0, params = 0, grads = 0; };
  static PoolSlots pool_slots(const ParamTable& t, const std::vector<int>& backward_order);

  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  // The shard buffers behind pieces(), at the layout's offsets (Offs::master, Offs::opt): what an offloaded optimizer
  // updates in place (DevZero's HostState).
  float* master_data() { return master_.data(); }
  float* exp_avg_data() { return exp_avg_.data(); }
  float* exp_avg_sq_data() { return exp_avg_sq_.data(); }
  ZeroMemory memory() const;  // master: what is held (less what release_frozen gave back)
  // The frozen pieces' masters back to the OS (the whole pages inside them); their pieces' master pointers become
  // null. For a run whose checkpoints do not hold the frozen tensors (LoRA) and whose gathers no longer read them
  // (DevZero::host_param_copy). Returns the bytes given back (whole pages; memory() no longer counts the pieces).
  int64_t release_frozen();
  // Every piece's master as a slice of its tensor: start-up fills them directly (load_hf_slices, init_random_slices),
  // so no rank ever holds the whole model.
  std::vector<ParamSlice> master_slices() const;

 private:
  std::vector<ShardPiece> pieces_;
  std::vector<float> master_, exp_avg_, exp_avg_sq_;
  int64_t released_ = 0;  // bytes of the pieces release_frozen() gave back
};

}  // namespace q3vl
