#pragma once
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/core/thread_pool.hpp"

#include "q3vl/model/dev_model.hpp"
#include "q3vl/parallel/dev_zero.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/train/optim.hpp"

namespace q3vl {

struct LossScaling {
  bool on = false;        // fp16 compute
  double scale = 1;       // current scale (the loss gradient is multiplied by it)
  int64_t window = 1000;  // good steps before the scale doubles
  int64_t good = 0;       // good steps since the last change
};

// The arena budget train sizes the GPU for: the largest micro-batch the loader can make. An image token stands for
// merge^2 patches; max_patches (train.max_patches, 0: as if every token were an image token) bounds them.
DevBudget train_budget(const ModelConfig& cfg, int64_t micro_batch, int64_t seq_len, int64_t max_patches);

// What lives in host memory instead of the device (parallel.offload_*): DevZero's part (OffloadSpec: optimizer,
// params, delayed, ring, ratio; "delayed" is DeepSpeed's delayed parameter update: step k's AdamW on the host while
// step k+1 computes on the weights from before it, gradients one step stale), and the trainer's.
struct Offload : OffloadSpec {
  // The masters and moments are the host engine's shards, updated in place (train's case; the planner's sizing says
  // in_place without an engine): the host holds them once, and checkpoints copy nothing.
  bool in_place = false;
  ZeroShards* state = nullptr;  // the constructor's: that engine (its layout is the trainer's)
  bool pin = false;             // bind the ring's threads (the host AdamW's) to the rank's cores, one each
};

// A DevTrainer's device memory by kind: the model's (stage 3: no weights or gradients of its own), the ZeRO shards
// and pools, and the norm scratch.
struct DevTrainerMemory {
  DevMemory model;
  DevZeroMemory zero;
  int64_t norm = 0;
  int64_t optimizer() const { return zero.master + zero.moments + norm; }  // fp32 masters + AdamW moments
  int64_t total() const { return model.total() + zero.total() + norm; }     // device bytes
  int64_t host() const { return zero.host_total(); }                         // offloaded state on the host
};

// Training on one device per rank (model.backend): the device model, and ZeRO-1/2/3 over the ranks (DevZero) with
// the fp32 master shards and AdamW moments in device memory; the gradient norm, AdamW and dynamic fp16 loss scaling
// there. On GPUs the shards move over NCCL (a communicator per group, on the trainer's stream), on CPU ranks (the CPU
// op layer) over MPI. The host engine's shards stay what checkpoints read and write: to_host before a checkpoint,
// from_host after start-up or a resume.
class DevTrainer {
 public:
  static constexpr int64_t kWorkspaceBytes = int64_t(256) << 20;  // the Exec's GEMM/attention workspace
  // The gradient norm's device bytes: its sum and non-finite count, then a slot of each a parameter (the squares
  // the backward takes as it writes a gradient: DevModel::take_grad_squares).
  static int64_t norm_bytes(int64_t params) { return 16 + (params * 12 + 7) / 8 * 8; }
  static constexpr int64_t kHostBlock = 8192;  // offloaded AdamW: elements updated, then converted, at a time
  // What a DevTrainer built with these arguments allocates on its device, without allocating (the planner's sizing):
  // rank 0's, the largest shard. (A CPU Exec has no workspace: tests size the CPU op layer with Device::CPU.)
  static DevTrainerMemory plan(const ModelConfig& cfg, DType dt, const DevBudget& budget, bool recompute,
                               const std::vector<bool>& trainable, int group = 1, int stage = 3,
                               Device d = Device::CUDA, bool gather_bf16 = false, const Offload& off = {});
  // shard: the group ZeRO shards over, replica (may be null): hybrid sharding's replicas; both host (MPI) comms that
  // outlive the trainer. On CUDA the trainer makes its NCCL communicators over the same ranks.
  // gather_bf16 (parallel.gather_dtype = "bf16", fp32 compute): units travel as the masters rounded to bf16.
  // ep (may be null; it outlives the trainer): expert parallelism over the shard group (no replicas): the model holds
  // this rank's experts, its rows move through ep (on GPUs over NCCL of ep's group, on the model's stream) and the
  // experts' units are sharded over ep's replicas. (plan(): budget.ep.)
  // off.optimizer: the masters and moments in host memory (DevZero's offload) and AdamW on the host's threads, with
  // the CPU op layer's arithmetic: on the CPU backend bitwise the run without offload.
  DevTrainer(Device d, int gpu, const ModelConfig& cfg, const std::vector<bool>& trainable, DType dt,
             const DevBudget& budget, bool recompute, LossScaling ls, Comm& shard, Comm* replica = nullptr,
             int stage = 3, bool gather_bf16 = false, ExpertParallel* ep = nullptr, const Offload& off = {});
  ~DevTrainer();

  // Masters and moments from the host engine's pieces (the same layout), and the compute weights.
  // Both land a delayed update first (settle), so a checkpoint holds the state after every step it counts.
  void from_host(const ZeroShards& e);
  void to_host(const ZeroShards& e);

  void begin_step();
  // A micro-batch's forward (kept for backward); backward adds weight * its loss's gradient (weight = n / n_global)
  // and returns the loss (the LM head and the loss run in the backward: DevModel::set_loss_in_backward), with the
  // aux loss in aux_out. A rank without tokens in a micro-step calls idle() instead of both: its collectives still
  // run (and its experts serve the others' rows).
  void forward(const PackedBatch& b, bool aux_loss = false);
  int64_t supervised_tokens() const { return model_->supervised_tokens(); }
  // LoRA's dropout draw for the next forward and its backward (model/lora.hpp: a new nonce per micro-step).
  void set_lora_draw(uint64_t seed, uint64_t nonce) {
    DevLora& l = model_->lora();
    l.train = true, l.seed = seed, l.nonce = nonce;
  }
  double backward(double weight, double* aux_out = nullptr);
  void idle();
  // The step's gradient shards complete (after the last micro-step).
  void finish_grads();
  // Squared norm of the (unscaled) gradient of the trainable parameters over every rank; false when any element is
  // not finite on any rank.
  double grad_norm_sq(bool* finite);
  // AdamW on every trainable parameter of this rank's shard (gscale: clipping), then the compute weights.
  void update(const AdamWConfig& hp, double lr, double gscale, int64_t t);
  // optim.update_in_backward (no clipping, no fp16 loss scaling, stage 3 with the optimizer on the device, no
  // replicas; DevZero::enable_unit_update): instead of grad_norm_sq() and update(), arm_update() before the step's
  // last micro-step (its forward or idle()) runs AdamW on each unit as soon as that micro-step's backward has made
  // the unit's gradient shard final, beside the rest of the backward; a unit with a non-finite gradient element on a
  // rank keeps its parameters and moments there. poison: train.debug_nan_step's NaN, in the first trained unit.
  void enable_update_in_backward();
  void arm_update(const AdamWConfig& hp, double lr, int64_t t, bool poison = false);
  // After the step (finish_grads): the gradient's squared norm over every rank (unscaled: no loss scaling here), the
  // trained units, and those some rank skipped (the first three's names).
  struct UnitUpdate {
    double norm_sq = 0;
    int64_t units = 0, skipped = 0;
    std::string names;
  };
  UnitUpdate unit_update();
  // A delayed update in flight lands: waited for, its parameters up (the next step computes on them). Nothing
  // otherwise.
  void settle();
  // Dynamic loss scaling after a step: an overflow halves the scale, `window` good steps double it.
  void after_step(bool finite);
  const LossScaling& loss_scaling() const { return ls_; }
  void set_loss_scale(double s) { ls_.scale = s; }
  // The communicator the shards move over ("nccl", "mpi", "none" for one rank).
  std::string comm_kind() const;
  const dev::Exec& exec() const { return ex_; }  // the compute stream
  int64_t gathered_bytes() const { return zero_->gathered_bytes(); }
  bool host_param_copy() const { return zero_->host_param_copy(); }  // DevZero's: the frozen masters unread

  std::string memory_report() const;
  DevTrainerMemory memory() const;  // what this trainer allocated on its device
  int64_t device_bytes() const { return memory().total(); }

 private:
  void host_update(const AdamWConfig& hp, double lr, double g, int64_t t);
  void host_adamw(const AdamWConfig& hp, double lr, double g, int64_t t);
  void device_adamw(const AdamWConfig& hp, double lr, double g, int64_t t);  // the runs the device holds
  void run_adamw(const DevZero::Run& r, const dev::Exec& ex, const AdamWConfig& hp, double lr, double g, int64_t t,
                 const int32_t* skip);
  struct Taken {
    int64_t a, b;  // [a, b) in the gradient shard
    int id;        // its parameter: the slot
  };
  std::vector<Taken> taken(int unit = -1) const;
  void sum_less(const dev::Exec& x, int64_t a, int64_t b, const std::vector<Taken>& took, double* sum, int32_t* bad);
  void sum_runs(const dev::Exec& x, const std::vector<int>* ids, const std::vector<Taken>& took, double* sum,
                int32_t* bad);
  void unit_squares(int u, const dev::Exec& x, double* sum, int32_t* bad);
  void add_taken(const std::vector<Taken>& took, double* sum, int32_t* nonfinite);
  dev::Exec ex_, cx_;  // compute; communication (NCCL's stream, when there are GPU peers)
  Comm& shard_;
  std::unique_ptr<Comm> nccl_shard_, nccl_replica_, nccl_ep_, nccl_experts_;  // nccl_ep_: the rows, nccl_experts_: ZeRO
  ExpertParallel* ep_ = nullptr;
  std::unique_ptr<DevModel> model_;
  std::unique_ptr<DevZero> zero_;
  std::unique_ptr<ThreadPool> pool_;  // offloaded optimizer's threads
  bool delayed_ = false;              // Offload::delayed
  bool in_bwd_ = false;               // enable_update_in_backward()
  std::future<void> pending_;         // the delayed update in flight
  double* norm_ = nullptr;  // [0] sum of squares; the int32 non-finite count follows; then sq_
  double* sq_ = nullptr;    // null, or the squares' slots: the sums [params], then the int32 counts [params]
  bool told_ = false;       // the log said the squares were taken
  // The update in the backward with squares taken: each unit's taken ids (device; pinned staging on the host), at
  // id_off_[unit]; what the step's checks took (the log's line).
  int32_t *ids_dev_ = nullptr, *ids_host_ = nullptr;
  std::vector<int64_t> id_off_;
  int64_t took_n_ = 0, took_bytes_ = 0;
  LossScaling ls_;
  bool hybrid_ = false;  // gradient shards all-reduced across replicas (parallel.hybrid over several nodes)
};

}  // namespace q3vl
