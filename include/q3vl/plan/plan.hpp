// The memory/time planner (`q3vl plan`, `parallel.layout = "auto"`): for a deck's model, sequence length and batch,
// every candidate training layout with its bytes per GPU and per host by kind and a predicted step time.
//
// Size once (DESIGN.md): every byte count comes from the functions the allocators call — ZeroShards::plan /
// zero_layout (the ZeRO shards), DevModel::activation_bytes (the activation arena), DevTrainer::plan (one GPU's
// trainer, optimizer offload included) — never from a second formula here. What this file adds is the part that is
// not allocated anywhere yet: how those pieces sit on GPUs for layouts not built so far (expert parallelism on
// GPUs), and the time model.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/core/dtype.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/parallel/dev_zero.hpp"
#include "q3vl/parallel/zero.hpp"

namespace q3vl {

// One kind of machine: GPUs per node, their memory and speeds, host memory per node.
struct Hardware {
  std::string gpu;               // preset name, or "custom"
  int nodes = 1, gpus_per_node = 1;
  int64_t gpu_mem = 0;           // bytes per GPU
  int64_t host_mem = 0;          // bytes per node
  double tflops = 0;             // dense bf16 TFLOP/s per GPU
  double nvlink_gbps = 0;        // within a node, per GPU and direction, Gbit/s
  double link_gbps = 0;          // between nodes, per GPU, Gbit/s
  double hbm_gbs = 0;            // GPU memory bandwidth, GB/s (the optimizer's speed)
  double pcie_gbs = 0;           // host <-> GPU, GB/s per direction (optimizer offload)
  double host_gbs = 100;         // host memory bandwidth per node for the host AdamW (offload): `q3vl check`'s figure
  int ranks() const { return nodes * gpus_per_node; }
  std::string describe() const;
};

// The presets' names (plan.gpu's choices) and values.
const std::vector<std::string>& gpu_preset_names();
Hardware gpu_preset(const std::string& name);
// "256GiB", "80GB", "1.5TiB" -> bytes; a number without a unit, or an unknown unit, fails naming `key`.
int64_t parse_bytes(const std::string& key, const std::string& text);
// plan.* keys -> the machine (errors name the key).
Hardware hardware_from_deck(const Deck& d);

// A training layout: what the deck lines select.
struct Layout {
  int stage = 3;            // parallel.zero_stage
  bool offload = false;     // parallel.offload_optimizer = "cpu": fp32 masters and AdamW moments on the host
  bool host_params = false; // parallel.offload_params = "frozen" (with offload): parameters streamed from the host
  bool delayed = false;     // parallel.offload_update = "delayed" (with offload, not host_params): the host AdamW
                            // under the next step
  double ratio = 1;         // parallel.offload_ratio (with offload, not host_params): the host's part of the update
  bool hybrid = false;      // parallel.hybrid: shard within a node, replicate across nodes
  int ep = 1;               // expert-parallel degree (parallel.ep): not built yet, always 1 here. EP would divide
                            // the expert units' bytes by ep and add all-to-all time; the place is sized_layout().
  int64_t micro_batch = 1;  // train.micro_batch
  bool recompute = false;   // train.recompute = "block"
  std::string describe() const;
  std::string deck_lines(DType gather) const;  // the [parallel]/[train] lines that select it
};

// Bytes by kind (per GPU, or per host rank).
struct Bytes {
  int64_t weights = 0, gathered = 0, grads = 0, optimizer = 0, activations = 0, workspace = 0, comm = 0;
  int64_t total() const { return weights + gathered + grads + optimizer + activations + workspace + comm; }
  std::string largest(int n) const;  // the n largest kinds with their GiB, largest first
};

// Host bytes per rank by kind: the host engine's shards that train keeps on every path (start-up and checkpoint I/O;
// an offloaded optimizer updates its masters and moments in place) and the offload's pinned staging (the ring the
// gradient shard goes down and the parameters come up through).
struct HostBytes {
  int64_t masters = 0, moments = 0, staging = 0;
  int64_t params = 0;  // parameters on the host: their pinned copy in the compute dtype
  int64_t total() const { return masters + moments + staging + params; }
  std::string largest(int n) const;
};

// What is being trained: the deck's model, precision, sequence and batch, the trained parameters.
struct Workload {
  ModelConfig cfg;
  std::string model_name;       // for the report
  DType dt = DType::BF16;       // model.dtype
  int64_t seq_len = 4096, global_batch = 8, max_patches = 0;
  std::vector<bool> trainable;  // per parameter (train.tune_*)
  std::vector<int> backward_order;  // unit_order(table, true)
  bool delayed_update = false;      // parallel.offload_update = "delayed": offloaded candidates use it
  // parallel.offload_chunk and parallel.offload_threads (the ring's slot pairs; 0, the rank's cores: 16 assumed)
  RingSpec offload_ring{RingSpec::kChunk, 16};
  // parallel.offload_ratio when the deck gives it; 0: sized (a delayed update: the part of the shard whose host
  // update the step hides, if the GPU holds the rest).
  double offload_ratio = 0;
};
Workload workload_from_deck(const Deck& d, std::string* note = nullptr);

struct Candidate {
  Layout layout;
  Bytes gpu;           // per GPU (the largest rank)
  HostBytes host;      // per rank on the host
  int64_t host_node = 0;  // per node: its ranks' host bytes + the reserve
  int64_t gpu_need = 0;   // gpu.total() + the per-GPU reserve
  double t_compute = 0, t_comm = 0, t_opt = 0, t_step = 0, flops = 0;
  double t_host_update = 0;  // offloaded: the host's update of the whole shard (what offload_ratio is sized from)
  int64_t micro_steps = 0;
  bool fits = false;
  bool built = false;  // train runs this layout today
  std::string why;     // why it does not fit
};

// One layout on one machine. Everything the planner reports goes through here.
Candidate sized_layout(const Workload& w, const Hardware& hw, const Layout& l);
// Every candidate (stage, offload, hybrid, ep, micro-batch, recompute), fastest fitting first.
std::vector<Candidate> plan_candidates(const Workload& w, const Hardware& hw);
// One rank's ZeRO shards on the host as `train` allocates them (ZeroShards): the test's exact check.
ZeroMemory host_zero_bytes(const Workload& w, int group_size, int rank);

// `q3vl plan DECK`: the report on stdout; 0 when some layout fits, 2 when none does.
int run_plan(const Deck& d);
// parallel.layout = "auto" for `train`: picks the fastest built layout that fits the devices this job has, sets its
// keys in `d` and logs the choice and why. Collective over the world communicator.
void choose_layout(Deck& d);

}  // namespace q3vl
