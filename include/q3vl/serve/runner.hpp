// The serving engine's model runner (as nano-vllm's ModelRunner): the ranks' layout (serve.tp tensor-parallel ranks
// in each of serve.pp pipeline stages), this rank's slice of the model with its step buffers and KV pools, and the
// step. Rank 0 runs the engine and sends each step's plan (the block manager's changes since the last step, the
// segments) to the other ranks, which replay and compute it; the logits, or each row's argmax, come back to rank 0.
// Every transfer is under the collectives' watchdog (runtime.timeout).
#pragma once
#include <mpi.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/runtime/comm.hpp"
#include "q3vl/serve/block_manager.hpp"

namespace q3vl {

// A watchdog's error: a rank of the group stopped answering; the server ends instead of going on out of step.
bool is_watchdog(const Error& e);

// What the engine is built for: serve's keys (serve_config), or generate's prompts (generate_config, engine.hpp).
struct EngineConfig {
  std::string mode = "serve";    // the deck's section (MODE.checkpoint) and the log's "MODE: "
  DevModel::InferBudget budget;  // the step buffers; kv_blocks: the KV pool (0: what memory allows, serve.kv_mib)
  int64_t max_batch = 1;         // sequences running together
  int64_t step_tokens = 1;       // tokens a step: one per decoding sequence, the rest prompt chunks
  bool prefix_cache = false;
  double timeout = 0;            // seconds a request may take from its arrival (0: no limit)
  double max_tpot = 0;           // serve.max_tpot_ms in seconds: prompt chunks sized to keep a step within it (0: off)
  bool vision_batch = true;      // serve.vision_batch: the images of jobs admitted together in one pass of the tower
  int64_t profile_steps = 0, profile_rows = 0;  // serve.profile_steps / serve.profile_rows
  std::string lower;             // the keys that shrink what the device must hold, for the messages
};
// serve.max_batch, serve.step_tokens, serve.prefix_cache, serve.timeout and serve_budget's step buffers.
EngineConfig serve_config(const Deck& d);

class Runner {
 public:
  Runner(const Deck& d, const EngineConfig& c, BlockManager& blocks);
  ~Runner();
  // The layout, the model (streamed from the deck's source; adapters folded first), its step buffers and KV pools
  // (the budget's, or sized from what the device, or the host, has left), and blocks reset to them.
  void load();
  // One model step on every rank: rank 0 passes the segments (the others receive them); rank 0 gets the logits
  // [segs, V], or with best (greedy steps) each segment's argmax in best->id. stop: rank 0 tells the others to end
  // (stopped() then).
  std::vector<float> step(std::vector<StepSegment<float>>& segs, bool stop = false, DevModel::Argmax* best = nullptr);
  // The ranks but 0: every step rank 0 sends, until it stops them (stop(), on rank 0).
  void follow();
  void stop();
  bool stopped() const { return stopped_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  const ModelConfig& config() const { return cfg_; }  // this rank's slice (the vocabulary and hidden size whole)
  DevModel& model() { return *dev_; }
  const std::string& checkpoint() const { return checkpoint_; }

 private:
  void build_model(const ModelSource& src, std::unique_ptr<HostWeights> host);
  void check_room(const ModelSource& src, DType dt, QFormat quant) const;
  void load_weights(const ModelSource& src, std::unique_ptr<HostWeights> host);
  std::string tensor_parallel(bool on_cpu, DType dt);
  std::string size_kv(DevModel::InferBudget& b, bool on_cpu, DType dt);
  bool share_plan(std::vector<StepSegment<float>>& segs, bool stop, DevModel::Argmax*& best, DevModel::Argmax& mine);
  std::vector<float> run_stage(const std::vector<StepSegment<float>>& segs, DevModel::Argmax* best);
  std::vector<float> from_last_stage(int64_t ns, DevModel::Argmax* best);
  void best_of_group(DevModel::Argmax& best, int64_t ns);
  std::vector<float> logits_to_root(const std::vector<float>& local, int64_t ns);
  void log_tp() const;
  std::unique_ptr<Comm> tp_mpi() const;  // the group over MPI, under the collectives' watchdog
  template <class T>
  void send(const T* p, size_t n, MPI_Datatype t, int to, int tag, const char* what);
  template <class T>
  void recv(T* p, size_t n, MPI_Datatype t, int from, int tag, const char* what);

  const Deck& deck_;
  const EngineConfig& ec_;
  BlockManager& blocks_;
  dev::Exec ex_{};
  std::unique_ptr<DevModel> dev_;
  std::unique_ptr<Comm> tp_comm_;  // the tensor-parallel group's sums: MPI, or NCCL on the device (serve.tp_comm)
  // The step plan's broadcasts, the stages' transfers (world_c_) and the group's gathers (tpc_c_), under the watchdog.
  std::unique_ptr<Comm> world_c_, tpc_c_;
  ModelConfig cfg_;
  std::string checkpoint_;
  // world_ ranks = pp_ pipeline stages of tp_ tensor-parallel ranks; this rank is trank_ of stage_ and computes in
  // tpc_ (its stage's ranks). Rank 0 (stage 0, trank 0) serves HTTP and runs the engine.
  // ep_: serve.ep, the sets of experts the group's ranks split the MoE layers into.
  int rank_ = 0, world_ = 1, tp_ = 1, pp_ = 1, stage_ = 0, trank_ = 0, ep_ = 1;
  MPI_Comm tpc_ = MPI_COMM_WORLD;
  DevStage dstage_;
  std::pair<int64_t, int64_t> vocab_rows_;
  bool stopped_ = false;
};

}  // namespace q3vl
