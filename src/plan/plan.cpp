// The planner (include/q3vl/plan/plan.hpp). Bytes come from the allocators' own sizing functions; the time model is
// FLOPs / GEMM rate + bytes / link bandwidth with the overlap the ZeRO engine implements.
#include "q3vl/plan/plan.hpp"
#include "q3vl/serve/tp.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/batch.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/tensor/dev.hpp"
#include "q3vl/train/dev_trainer.hpp"
#include "q3vl/train/flops.hpp"
#include "q3vl/train/train.hpp"

namespace q3vl {

namespace {

constexpr double kGiB = double(int64_t(1) << 30);
// Model assumptions that are not byte counts (stated in the report). A GEMM-bound step reaches about half the
// dense peak (DESIGN.md's target is 55-60% MFU); collectives about 80% of the link.
constexpr double kGemmEfficiency = 0.5;
constexpr double kLinkEfficiency = 0.8;
constexpr double kHbmEfficiency = 0.7;
// Parameters streamed from the host (offload_params = frozen) arrive a unit at a time, each copy ordered by events
// around the pool's slots: the 235B LoRA cut on one H200 moved them at 79% of the pinned-copy rate `q3vl check`
// measures (2.28 s a step against 1.81 s planned at the full rate; docs/PERFORMANCE.md, 2026-12-02).
constexpr double kStreamEfficiency = 0.79;
constexpr int64_t kGpuReserve = int64_t(3) << 29;    // 1.5 GiB: CUDA context, NCCL buffers, allocator slack
constexpr int64_t kHostReserve = int64_t(16) << 30;  // per node: OS, the processes' code, the loader, MPI
constexpr double kAdamBytes = 28;                    // AdamW reads p, g, m, v and writes p, m, v (fp32)

std::string gib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", double(b) / kGiB);
  return buf;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

// ---- hardware ----

const std::vector<std::string>& gpu_preset_names() {
  static const std::vector<std::string> n = {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"};
  return n;
}

Hardware gpu_preset(const std::string& name) {
  // Memory as the driver reports it; dense bf16 peak; NVLink per direction; one NIC per GPU (HDR 200 Gbit/s on
  // A100 systems, NDR 400 on H100/H200); HBM bandwidth; PCIe 4 (A100) or 5 effective per direction.
  Hardware h;
  h.gpu = name;
  const int64_t MiB = int64_t(1) << 20;
  if (name == "A100-40GB") h.gpu_mem = 40960 * MiB, h.tflops = 312, h.nvlink_gbps = 2400, h.link_gbps = 200,
                           h.hbm_gbs = 1555, h.pcie_gbs = 25;
  else if (name == "A100-80GB") h.gpu_mem = 81920 * MiB, h.tflops = 312, h.nvlink_gbps = 2400, h.link_gbps = 200,
                                h.hbm_gbs = 2039, h.pcie_gbs = 25;
  else if (name == "H100-80GB") h.gpu_mem = 81559 * MiB, h.tflops = 989, h.nvlink_gbps = 3600, h.link_gbps = 400,
                                h.hbm_gbs = 3350, h.pcie_gbs = 50;
  else if (name == "H200-141GB") h.gpu_mem = 143771 * MiB, h.tflops = 989, h.nvlink_gbps = 3600, h.link_gbps = 400,
                                 h.hbm_gbs = 4800, h.pcie_gbs = 50;
  else {
    std::string list;
    for (const auto& n : gpu_preset_names()) list += (list.empty() ? "" : ", ") + n;
    fail_all("plan.gpu = \"" + name + "\": unknown GPU (presets: " + list +
             "; or give plan.gpu_mem, plan.gpu_tflops, plan.link_gbps by hand)");
  }
  return h;
}

int64_t parse_bytes(const std::string& key, const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit((unsigned char)text[i]) || text[i] == '.')) ++i;
  const std::string num = text.substr(0, i);
  std::string unit = text.substr(i);
  unit.erase(0, unit.find_first_not_of(' '));
  const std::string ex = " (e.g. 256GiB, 80GB, 2TiB)";
  if (num.empty() || std::count(num.begin(), num.end(), '.') > 1)
    fail_all(key + " = \"" + text + "\": not a memory size" + ex);
  if (unit.empty()) fail_all(key + " = \"" + text + "\": a memory size needs a unit" + ex);
  static const std::map<std::string, double> units = {
      {"B", 1},      {"KB", 1e3},         {"MB", 1e6},         {"GB", 1e9},         {"TB", 1e12},
      {"KiB", 1024}, {"MiB", 1048576.0},  {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  auto u = units.find(unit);
  if (u == units.end()) fail_all(key + " = \"" + text + "\": unknown unit '" + unit + "'" + ex);
  const double v = std::stod(num) * u->second;
  if (!(v >= 1)) fail_all(key + " = \"" + text + "\": must be more than zero bytes");
  return int64_t(v);
}

Hardware hardware_from_deck(const Deck& d) {
  Hardware h = gpu_preset(d.str("plan.gpu"));
  h.nodes = int(d.integer("plan.nodes"));
  h.gpus_per_node = int(d.integer("plan.gpus_per_node"));
  h.host_mem = parse_bytes("plan.host_mem", d.str("plan.host_mem"));
  if (!d.str("plan.gpu_mem").empty()) h.gpu_mem = parse_bytes("plan.gpu_mem", d.str("plan.gpu_mem")), h.gpu += "*";
  if (d.real("plan.gpu_tflops") > 0) h.tflops = d.real("plan.gpu_tflops"), h.gpu += "*";
  if (d.real("plan.link_gbps") > 0) h.link_gbps = d.real("plan.link_gbps");
  if (d.real("plan.nvlink_gbps") > 0) h.nvlink_gbps = d.real("plan.nvlink_gbps");
  if (d.real("plan.pcie_gbs") > 0) h.pcie_gbs = d.real("plan.pcie_gbs");
  if (d.real("plan.host_gbs") > 0) h.host_gbs = d.real("plan.host_gbs");
  return h;
}

std::string Hardware::describe() const {
  return std::to_string(nodes) + " node(s) x " + std::to_string(gpus_per_node) + " " + gpu + " (" + gib(gpu_mem) +
         " GiB, " + fmt("%.0f", tflops) + " TFLOP/s bf16, NVLink " + fmt("%.0f", nvlink_gbps) + " Gbit/s, network " +
         fmt("%.0f", link_gbps) + " Gbit/s per GPU, PCIe " + fmt("%.0f", pcie_gbs) + " GB/s), host " + gib(host_mem) +
         " GiB and " + fmt("%.0f", host_gbs) + " GB/s per node";
}

// ---- layouts ----

std::string Layout::describe() const {
  const std::string part = offload && ratio < 1 ? fmt(" of %.2f of the shard", ratio) : "";
  return "ZeRO-" + std::to_string(stage) +
         (offload ? (delayed ? " + optimizer offload" + part + " (delayed update)" : " + optimizer offload" + part) : "") +
         (host_params ? " + parameters on the host" : "") + (hybrid ? ", hybrid" : "") +
         (ep > 1 ? ", EP " + std::to_string(ep) : "") + ", micro-batch " + std::to_string(micro_batch) +
         ", recompute " + (recompute ? "block" : "none");
}

std::string Layout::deck_lines(DType gather) const {
  std::string s = "[parallel]\nzero_stage = " + std::to_string(stage) + "\nhybrid = " + (hybrid ? "true" : "false") +
                  "\n";
  if (gather != DType::F32) s += "gather_dtype = \"bf16\"\n";
  if (offload) s += "offload_optimizer = \"cpu\"\n";
  if (offload && delayed) s += "offload_update = \"delayed\"\n";
  if (offload && ratio < 1) s += fmt("offload_ratio = %.2f\n", ratio);
  if (host_params) s += "offload_params = \"frozen\"\n";
  if (ep > 1) s += "ep = " + std::to_string(ep) + "\n";
  s += "[train]\nmicro_batch = " + std::to_string(micro_batch) + "\nrecompute = \"" + (recompute ? "block" : "none") +
       "\"\n";
  return s;
}

std::string Bytes::largest(int n) const {
  std::pair<int64_t, const char*> k[] = {{weights, "weights"},         {gathered, "gathered units"},
                                         {grads, "gradients"},         {optimizer, "optimizer state"},
                                         {activations, "activations"}, {workspace, "workspace"},
                                         {comm, "comm buffers"}};
  std::stable_sort(std::begin(k), std::end(k), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string s;
  for (int i = 0; i < n && k[i].first > 0; ++i) s += (i ? ", " : "") + std::string(k[i].second) + " " + gib(k[i].first);
  return s;
}

std::string HostBytes::largest(int n) const {
  std::pair<int64_t, const char*> k[] = {{masters, "fp32 masters"}, {moments, "AdamW moments"},
                                         {staging, "pinned staging"}, {params, "parameters (pinned)"}};
  std::stable_sort(std::begin(k), std::end(k), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string s;
  for (int i = 0; i < n && k[i].first > 0; ++i) s += (i ? ", " : "") + std::string(k[i].second) + " " + gib(k[i].first);
  return s;
}

// ---- workload ----

Workload workload_from_deck(const Deck& d, std::string* note) {
  Workload w;
  std::string json;
  const std::string hf = d.str("model.hf");
  if (!hf.empty() && !std::filesystem::exists(hf + "/config.json")) {
    // Planning happens before the weights are downloaded: a released size named in the path is enough.
    std::string best;
    for (const auto& n : preset_names())
      if (hf.find(n) != std::string::npos && n.size() > best.size()) best = n;
    if (best.empty())
      fail_all("model.hf = \"" + hf + "\": no config.json there, and the path names no built-in size (" +
               "give model.preset instead)");
    w.cfg = preset_config(best);
    w.model_name = best;
    if (note) *note = "model.hf's config.json is not here: sizing the built-in " + best + " (the released config)";
  } else {
    w.cfg = model_config(d, &json);
    w.model_name = !d.str("model.preset").empty() ? d.str("model.preset") : hf;
  }
  w.cfg.lora = lora_config(d);  // model_config's too, for the released config named by the path
  w.dt = compute_dtype(d.str("model.dtype"));
  w.seq_len = d.integer("data.seq_len");
  w.global_batch = d.integer("train.global_batch");
  w.max_patches = d.integer("train.max_patches");
  w.delayed_update = d.str("parallel.offload_update") == "delayed";
  w.offload_ring.chunk = d.integer("parallel.offload_chunk");
  if (d.integer("parallel.offload_threads") > 0) w.offload_ring.threads = int(d.integer("parallel.offload_threads"));
  if (d.given("parallel.offload_ratio")) w.offload_ratio = d.real("parallel.offload_ratio");
  const ParamTable t(w.cfg);
  w.trainable = trainable_flags(t, d);
  w.backward_order = unit_order(t, true);
  return w;
}

ZeroMemory host_zero_bytes(const Workload& w, int n, int r) {
  return ZeroShards::plan(ParamTable(w.cfg), n, r, w.trainable);
}

// ---- one layout ----

namespace {

// The largest value of each kind over a shard group's ranks (rank 0 holds the most unless frozen tensors sit
// unevenly). Cached: the search sizes the same groups many times.
// ep > 1: the expert units are sharded over the n / ep ranks holding the same experts (groups of ep consecutive
// ranks split the experts, as ExpertParallel lays them out).
ZeroMemory zero_max(const Workload& w, const ParamTable& t, int n, int ep = 1) {
  // Keyed by what the layout depends on: the table (its size and unit count stand for it), the trained set, n, stage.
  static std::map<std::tuple<int64_t, size_t, std::vector<bool>, int, int>, ZeroMemory> cache;
  auto key = std::make_tuple(t.total(), t.units().size(), w.trainable, n, ep);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  ZeroMemory m;
  auto mx = [](int64_t& a, int64_t b) { a = std::max(a, b); };
  for (int r = 0; r < n; r += std::max(1, n / 16)) {  // evenly spread ranks: the pieces repeat with the rank
    const ShardGroup experts{n / ep, r / ep};
    const ZeroMemory z = ZeroShards::plan(t, n, r, w.trainable, ep > 1 ? &experts : nullptr);
    mx(m.master, z.master), mx(m.exp_avg, z.exp_avg), mx(m.exp_avg_sq, z.exp_avg_sq), mx(m.frozen, z.frozen);
  }
  return cache[key] = m;
}

// DevTrainer::plan for a layout, cached as zero_max is (the search sizes the same layouts for every node count).
DevTrainerMemory trainer_bytes(const Workload& w, const ParamTable& t, const DevBudget& b, const Layout& l, int n) {
  using Key = std::tuple<int64_t, size_t, std::vector<bool>, DType, int64_t, int64_t, int64_t, int, int, int, int,
                         int64_t, int, double>;
  static std::map<Key, DevTrainerMemory> cache;
  const Key key{t.total(), t.units().size(), w.trainable, w.dt, b.tokens, b.patches, b.segments, b.ep, n, l.stage,
                int(l.recompute) + 2 * int(l.offload) + 4 * int(l.host_params) + 8 * int(l.delayed),
                w.offload_ring.chunk, w.offload_ring.threads, l.offload ? l.ratio : 1.0};
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  Offload off;
  off.ratio = l.offload && !l.host_params ? l.ratio : 1.0;
  off.optimizer = off.in_place = l.offload;  // onto the host engine's shards in place, as train does
  off.params = l.host_params;
  off.delayed = l.delayed;  // the device gradient shard and parameter copy twice
  off.ring = w.offload_ring;
  return cache[key] = DevTrainer::plan(w.cfg, w.dt, b, l.recompute, w.trainable, n, l.stage, Device::CUDA, false, off);
}

}  // namespace

Candidate sized_layout(const Workload& w, const Hardware& hw, const Layout& l) {
  Candidate c;
  c.layout = l;
  const ParamTable t(w.cfg, {l.ep, 0});  // under expert parallelism a rank holds E/ep experts of every MoE layer
  const int R = hw.ranks(), n = l.hybrid ? hw.gpus_per_node : R;
  const int64_t g = int64_t(dtype_size(w.dt));
  DevBudget budget = train_budget(w.cfg, l.micro_batch, w.seq_len, w.max_patches);
  budget.ep = l.ep;  // an owner's experts are sized for the rows of its whole EP group
  int64_t trained = 0;
  for (size_t i = 0; i < w.trainable.size(); ++i) trained += w.trainable[i] ? t.param(int(i)).numel : 0;

  // GPU bytes: what train allocates, the DevTrainer's own sizing (ZeRO over the shard group; expert units over their
  // replicas; offloaded, onto the host engine's shards in place, as train does). Expert parallelism on GPUs is sized
  // the same way but not built (measured) yet.
  const DevTrainerMemory d = trainer_bytes(w, t, budget, l, n);
  c.gpu.weights = d.model.weights;
  c.gpu.grads = d.model.grads + d.zero.grads;
  c.gpu.optimizer = d.optimizer();
  c.gpu.gathered = d.zero.pool;
  c.gpu.activations = d.model.activations;
  c.gpu.workspace = d.model.workspace;
  c.gpu.comm = d.zero.comm;
  c.built = l.ep == 1;
  // Host bytes per rank: train keeps the ZeRO engine's shards on the host on the GPU path too (stage 3: checkpoint
  // staging; offload updates them there in place), and offload adds its pinned staging (d.host(): the trainer's).
  {
    const ZeroMemory h = zero_max(w, t, n, l.ep);
    // LoRA with its base on the host in the compute dtype: the base's fp32 masters are released (train).
    c.host.masters = h.master - (w.cfg.lora.on() && d.zero.host_params > 0 ? h.frozen : 0);
    c.host.moments = h.exp_avg + h.exp_avg_sq;
    c.host.params = d.zero.host_params;
    c.host.staging = d.host() - d.zero.host_params;
  }
  c.host_node = int64_t(hw.gpus_per_node) * c.host.total() + kHostReserve;
  c.gpu_need = c.gpu.total() + kGpuReserve;
  c.fits = c.gpu_need <= hw.gpu_mem && c.host_node <= hw.host_mem;
  if (c.gpu_need > hw.gpu_mem)
    c.why = "GPU needs " + gib(c.gpu_need) + " GiB of " + gib(hw.gpu_mem) + " (most: " + c.gpu.largest(1) + " GiB)";
  if (c.host_node > hw.host_mem)
    c.why += std::string(c.why.empty() ? "" : "; ") + "host needs " + gib(c.host_node) + " GiB per node of " +
             gib(hw.host_mem);

  // Time. Each rank runs micro_steps micro-batches of micro_batch packed sequences per step (text tokens only:
  // images add their patches' ViT FLOPs).
  c.micro_steps = std::max<int64_t>(1, (w.global_batch + int64_t(R) * l.micro_batch - 1) / (int64_t(R) * l.micro_batch));
  FlopCounts fc;
  fc.tokens = double(l.micro_batch * w.seq_len);
  fc.text_keys = double(l.micro_batch) * double(w.seq_len) * double(w.seq_len + 1) / 2;
  const double flops_micro = train_flops(t, fc);
  c.flops = flops_micro * double(c.micro_steps) * R;  // model FLOPs of the step (MFU's numerator)
  const double rate = hw.tflops * 1e12 * kGemmEfficiency;
  const double t_micro = flops_micro * (l.recompute ? 4.0 / 3.0 : 1.0) / rate;  // recompute: one more forward
  c.t_compute = t_micro * double(c.micro_steps);
  // Ring collectives move (n-1)/n of the buffer per rank; a group spanning nodes runs at the network's speed.
  const bool spans = !l.hybrid && hw.nodes > 1;
  const double bw = (spans ? hw.link_gbps : hw.nvlink_gbps) / 8 * 1e9 * kLinkEfficiency;
  const double f = n > 1 ? double(n - 1) / n : 0.0, P = double(t.total()), Ptr = double(trained);
  const double gather = P * double(g) * f / bw, reduce = Ptr * 4 * f / bw;
  double exposed = 0;
  if (R > 1) {
    if (l.stage == 3) {
      // Each unit is gathered for forward and backward (prefetched one ahead) and its gradients reduce-scattered
      // as soon as complete: hidden behind compute up to the compute time; the first gather is not.
      const ZeroShards::PoolSlots s = ZeroShards::pool_slots(t, w.backward_order);
      const double per_micro = 2 * gather + reduce;
      exposed = double(c.micro_steps) * std::max(0.0, per_micro - t_micro) + double(s.biggest) * double(g) * f / bw;
    } else if (l.stage == 2) {
      // Reduce-scatters overlap the next micro-step's forward (a third of it); the last one and the gather after
      // the update are exposed.
      exposed = double(c.micro_steps - 1) * std::max(0.0, reduce - t_micro / 3) + reduce + gather;
    } else {
      exposed = reduce + gather;  // once per step, after the last backward and after the update
    }
    if (l.ep > 1) {
      // Expert all-to-all, blocking (not overlapped): each MoE layer sends every routed (token, expert) row of
      // `hidden` values to its owner and back (dispatch, combine) in forward, again in backward, and once more in a
      // recomputed forward; (ep-1)/ep of the rows leave the rank, over NVLink while the EP group is inside a node.
      const TextConfig& tc = w.cfg.text;
      int moe_layers = 0;
      for (int i = 0; i < tc.layers; ++i) moe_layers += t.moe_layer(i) ? 1 : 0;
      const double rows = double(l.micro_batch * w.seq_len) * tc.experts_per_tok;
      const double bytes = rows * tc.hidden * double(g) * 2 * (l.recompute ? 3 : 2) * moe_layers;
      const double ep_bw = (l.ep <= hw.gpus_per_node ? hw.nvlink_gbps : hw.link_gbps) / 8 * 1e9 * kLinkEfficiency;
      exposed += double(c.micro_steps) * bytes * double(l.ep - 1) / l.ep / ep_bw;
    }
    if (l.hybrid && hw.nodes > 1)  // gradient shards all-reduced across nodes, blocking, in finish_grads
      exposed += 2 * (Ptr * 4 / n) * double(hw.nodes - 1) / hw.nodes / (hw.link_gbps / 8 * 1e9 * kLinkEfficiency);
  }
  if (l.host_params) {
    // Every unit's shard comes up from the host in the gathers' dtype for its forward and its backward use (stage 3;
    // stages 1/2 once a step), prefetched a unit ahead: exposed beyond the micro-step's compute, the first unit's never
    // hidden.
    const double up = P / n * double(g) / (hw.pcie_gbs * 1e9 * kStreamEfficiency);
    exposed += l.stage == 3 ? double(c.micro_steps) * std::max(0.0, 2 * up - t_micro) : up;
  }
  c.t_comm = exposed;
  const double shard = Ptr / n;
  if (!l.offload) {
    c.t_opt = kAdamBytes * shard / (hw.hbm_gbs * 1e9 * kHbmEfficiency);
  } else {
    // AdamW and the conversion on the host's memory bandwidth, shared by its ranks, and the copies through the ring
    // (the gradient shard down, the parameters up) behind it, chunk by chunk: the longer of the two. The synchronous
    // update runs between the steps; the delayed one under the next step, exposed where it outlasts it.
    // Partial offload (ratio < 1): the host's part only; the device updates the rest at once, beside it (sync) or
    // before the next step (delayed).
    const double r = l.host_params ? 1.0 : l.ratio;
    const double host = r * (kAdamBytes + double(g)) * shard * hw.gpus_per_node / (hw.host_gbs * 1e9);
    const double copies = r * double(l.host_params ? 4 : 4 + g) * shard / (hw.pcie_gbs * 1e9);
    const double on_device = (1 - r) * (kAdamBytes + double(g)) * shard / (hw.hbm_gbs * 1e9 * kHbmEfficiency);
    const double update = std::max(host, copies), compute = c.t_compute + c.t_comm;
    c.t_opt = l.delayed ? on_device + std::max(0.0, update - compute) : std::max(update, on_device);
    c.t_host_update = update / r;  // the whole shard's, what a ratio is sized from
  }
  c.t_step = c.t_compute + c.t_comm + c.t_opt;
  return c;
}

std::vector<Candidate> plan_candidates(const Workload& w, const Hardware& hw) {
  std::vector<Candidate> out;
  const int R = hw.ranks();
  for (int stage : {1, 2, 3})
    for (int offload : {0, 1, 2})  // none, the optimizer, the optimizer and the parameters (something frozen)
      for (bool hybrid : {false, true}) {
        if (offload == 2 && std::all_of(w.trainable.begin(), w.trainable.end(), [](bool b) { return b; })) continue;
        if (hybrid && (hw.nodes < 2 || hw.gpus_per_node < 2)) continue;
        if (R == 1 && stage != 3) continue;  // one GPU: the stages are the same (nothing to shard)
        for (int ep = 1; ep <= R; ep *= 2) {
          // Expert parallelism: degrees dividing the ranks and the experts; not with hybrid sharding (refused).
          if (ep > 1 && (!w.cfg.moe() || R % ep || w.cfg.text.num_experts % ep || hybrid)) continue;
          for (int64_t mb : {1, 2, 4, 8}) {
            if (mb > 1 && int64_t(R) * mb > w.global_batch) break;  // ranks would sit idle
            for (bool rc : {false, true}) {
              Layout l;
              l.stage = stage, l.offload = offload > 0, l.host_params = offload == 2, l.hybrid = hybrid, l.ep = ep;
              l.delayed = offload == 1 && w.delayed_update;
              l.micro_batch = mb, l.recompute = rc;
              if (offload == 1 && w.offload_ratio > 0) l.ratio = w.offload_ratio;
              out.push_back(sized_layout(w, hw, l));
              if (offload == 1 && w.offload_ratio == 0 && l.delayed) {  // sized: what the step hides, if it fits
                const Candidate& full = out.back();
                const double hides = (full.t_compute + full.t_comm) / full.t_host_update;
                if (hides < 1) {
                  l.ratio = std::max(0.05, std::floor(hides * 20) / 20);
                  if (Candidate c = sized_layout(w, hw, l); c.fits) out.back() = c;
                }
              }
            }
          }
        }
      }
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits) {  // equal times (to 3 digits): the one that needs less memory
      const double ta = std::stod(fmt("%.3g", a.t_step)), tb = std::stod(fmt("%.3g", b.t_step));
      return ta != tb ? ta < tb : a.gpu_need < b.gpu_need;
    }
    // Misses: the one closest to fitting first.
    auto over = [](const Candidate& c) { return double(c.gpu_need) + double(c.host_node) * 1e-3; };
    return over(a) < over(b);
  });
  return out;
}

// ---- q3vl plan ----

namespace {

std::string row(const Candidate& c) {
  const Layout& l = c.layout;
  const Bytes& b = c.gpu;
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "  %d  %-3s %-3s %2d %3lld %-5s | %7s %7s %7s %7s %7s %5s %5s | %7s %8s | %8.2f %6.2f %s",
                l.stage, l.host_params ? "y+p" : l.offload ? "yes" : "no", l.hybrid ? "yes" : "no", l.ep,
                (long long)l.micro_batch,
                l.recompute ? "block" : "none", gib(b.weights).c_str(), gib(b.gathered).c_str(), gib(b.grads).c_str(),
                gib(b.optimizer).c_str(), gib(b.activations).c_str(), gib(b.workspace).c_str(), gib(b.comm).c_str(),
                gib(c.gpu_need).c_str(), gib(c.host_node).c_str(), c.t_step, c.t_comm,
                c.fits ? (c.layout.offload && !c.built ? "fits (offload not built)" : "fits") : "no");
  return buf;
}

const char* kHeader =
    "  ZeRO off hyb ep  mb recmp | weights gathrd   grads   optim  activ  work  comm | GPU tot host/node |   step s "
    "comm s\n";

// Fewest nodes of this kind (same GPU, GPUs and host memory per node) on which some layout with this offload fits.
int fewest_nodes(const Workload& w, Hardware hw, bool offload, Candidate* best) {
  auto fits = [&](int nodes, Candidate* out) {
    hw.nodes = nodes;
    for (const Candidate& c : plan_candidates(w, hw))
      if (c.fits && c.layout.offload == offload) {
        if (out) *out = c;
        return true;
      }
    return false;
  };
  int hi = 1;
  while (!fits(hi, nullptr)) {
    if (hi >= 4096) return -1;
    hi *= 2;
  }
  int lo = hi / 2;  // lo does not fit (or is 0)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (fits(mid, nullptr) ? hi : lo) = mid;
  }
  fits(hi, best);
  return hi;
}

int plan_serve(const Deck& d, const Workload& w, const Hardware& hw) {
  // serve's own sizing (Server::load_device): on each GPU the fullest pipeline stage's slice of the weights
  // (DevModel::weight_bytes), its step and vision buffers (infer_bytes for serve.step_tokens, serve.max_batch and
  // serve.max_context), the workspace and the reserve; what is left holds the KV cache (kv_pool_bytes).
  const TextConfig& tc = w.cfg.text;
  const int64_t ctx = d.integer("serve.max_context");
  const DevModel::InferBudget b = serve_budget(d);
  std::printf("serve layouts (serve's sizing: the fullest stage's slice of the weights, step buffers for %lld tokens "
              "and %lld sequences, KV cache bf16, context %lld tokens):\n",
              (long long)b.tokens, (long long)b.segments, (long long)ctx);
  std::printf("  GPUs  TP  PP  EP weights  | weights/GPU  buffers/GPU  KV/token/GPU  KV capacity       sequences\n");
  bool any = false;
  // Tensor parallelism within a node, pipeline stages within or across nodes; a MoE model's experts split by rows over
  // the TP ranks (EP 1) or whole (EP = TP, serve.ep).
  for (int tp = 1; tp <= hw.gpus_per_node; tp *= 2)
    for (int pp = 1; tp * pp <= hw.ranks() && pp <= tc.layers; pp *= 2)
      for (const int ep : tc.num_experts && tp > 1 ? std::vector<int>{1, tp} : std::vector<int>{1}) {
        ModelConfig slice;
        try {
          slice = tp_config(w.cfg, 0, tp, ep);
        } catch (const Error& e) {
          std::printf("  %4d  %2d  %2d  %2d          | %s\n", tp * pp, tp, pp, ep, e.what());
          continue;
        }
        const ParamTable t(slice, tp_experts(0, tp, ep));  // every rank holds as many experts and rows
        for (const QFormat quant : {QFormat::None, QFormat::Int8}) {  // fp8 holds int8's bytes
          int64_t wmax = 0, bmax = 0, kvtok = 0, tokens = std::numeric_limits<int64_t>::max();
          for (int s = 0; s < pp; ++s) {
            const DevStage st = DevStage::of(s, pp, tc.layers);
            const int64_t wb = DevModel::weight_bytes(t, DType::BF16, st, quant);
            const int64_t buf = DevModel::infer_bytes(slice, DType::BF16, b, st);
            const int64_t kv = DevModel::kv_pool_bytes(slice, DType::BF16, 1, 1, st);
            const int64_t left = hw.gpu_mem - kGpuReserve - int64_t(DevModel::kInferWorkspace) - wb - buf;
            wmax = std::max(wmax, wb), bmax = std::max(bmax, buf), kvtok = std::max(kvtok, kv);
            tokens = std::min(tokens, left > 0 ? left / kv : 0);
          }
          any = any || tokens >= ctx;
          std::printf("  %4d  %2d  %2d  %2d  %-8s| %8s GiB  %8s GiB  %9lld B  %9lld tok  %9lld\n", tp * pp, tp, pp, ep,
                      quant == QFormat::None ? "bf16" : "int8/fp8", gib(wmax).c_str(), gib(bmax).c_str(),
                      (long long)kvtok, (long long)tokens, (long long)(tokens / ctx));
        }
      }
  return any ? 0 : 2;
}

}  // namespace

int run_plan(const Deck& d) {
  const Hardware hw = hardware_from_deck(d);
  std::string note;
  const Workload w = workload_from_deck(d, &note);
  const ParamTable t(w.cfg);
  if (Runtime::get().world().rank() != 0) return 0;  // one report
  int64_t trained = 0;
  for (size_t i = 0; i < w.trainable.size(); ++i) trained += w.trainable[i] ? t.param(int(i)).numel : 0;
  std::printf("plan: Qwen3-VL %s, %.2f B parameters (%.2f B trained), compute %s\n", w.model_name.c_str(),
              double(t.total()) / 1e9, double(trained) / 1e9, dtype_name(w.dt));
  if (!note.empty()) std::printf("  %s\n", note.c_str());
  std::printf("hardware: %s\n", hw.describe().c_str());
  if (d.str("plan.for") == "serve") return plan_serve(d, w, hw);
  std::printf("training: seq_len %lld, global batch %lld sequences, %d rank(s)\n", (long long)w.seq_len,
              (long long)w.global_batch, hw.ranks());
  std::printf("model states unsharded: fp32 masters %s GiB, AdamW moments %s GiB, fp32 gradients %s GiB: %s GiB in "
              "all (%.2f TB)\n",
              gib(t.total() * 4).c_str(), gib(trained * 8).c_str(), gib(trained * 4).c_str(),
              gib(t.total() * 4 + trained * 12).c_str(), double(t.total() * 4 + trained * 12) / 1e12);
  std::printf("machine totals: GPU %s GiB, host %s GiB\n", gib(int64_t(hw.ranks()) * hw.gpu_mem).c_str(),
              gib(int64_t(hw.nodes) * hw.host_mem).c_str());

  const std::vector<Candidate> cs = plan_candidates(w, hw);
  std::printf("\ncandidates, GiB per GPU (the largest rank) and per node's host; step time predicted:\n%s", kHeader);
  const size_t show = std::min(cs.size(), size_t(d.integer("plan.show")));
  for (size_t i = 0; i < show; ++i) std::printf("%s\n", row(cs[i]).c_str());
  if (show < cs.size()) std::printf("  ... %zu more (plan.show)\n", cs.size() - show);
  std::printf("  (GPU tot adds %s GiB of CUDA context and NCCL; host/node adds %s GiB for the OS and processes. "
              "Time: FLOPs at %.0f%% of peak, links at %.0f%%, the ZeRO engine's overlap; text tokens only.)\n",
              gib(kGpuReserve).c_str(), gib(kHostReserve).c_str(), kGemmEfficiency * 100, kLinkEfficiency * 100);
  if (w.cfg.moe())
    std::printf("  (MoE: each MoE layer's experts are a ZeRO unit of their own; with ep > 1 a rank holds E/ep of "
                "them, sharded over the ranks holding the same experts, and the all-to-all is counted as exposed. "
                "A rank's expert buffers are sized for the rows of its whole EP group (dropless). On GPUs the "
                "all-to-all runs over NCCL, not measured yet.)\n");

  const Candidate& best = cs.front();
  int rc = 0;
  if (best.fits) {
    const double tokens = double(w.global_batch * w.seq_len);
    std::printf("\nfastest that fits: %s\n  %s GiB per GPU of %s, %s GiB host per node of %s; step %.2f s "
                "(compute %.2f, exposed comm %.2f, optimizer %.2f), %.0f tokens/s, MFU %.0f%%\n",
                best.layout.describe().c_str(), gib(best.gpu_need).c_str(), gib(hw.gpu_mem).c_str(),
                gib(best.host_node).c_str(), gib(hw.host_mem).c_str(), best.t_step, best.t_compute, best.t_comm,
                best.t_opt, tokens / best.t_step, 100 * best.flops / best.t_step / (hw.tflops * 1e12 * hw.ranks()));
    std::printf("deck lines:\n%s", best.layout.deck_lines(w.dt).c_str());
  } else {
    rc = 2;
    std::printf("\nnothing fits on %d x %d %s with %s GiB host per node.\n  closest: %s: %s\n", hw.nodes,
                hw.gpus_per_node, hw.gpu.c_str(), gib(hw.host_mem).c_str(), best.layout.describe().c_str(),
                best.why.c_str());
    std::printf("  dominant, GiB per GPU: %s; per host rank: %s\n", best.gpu.largest(3).c_str(),
                best.host.largest(3).c_str());
  }
  // The smallest hardware of this kind, with and without offload (asked either way: it is the question users have).
  std::printf("\nfewest nodes of %d x %s with %s GiB host each:\n", hw.gpus_per_node, hw.gpu.c_str(),
              gib(hw.host_mem).c_str());
  {  // The floor no layout without offload beats: the model states alone (masters, moments, gradients) on the GPUs.
    const int64_t states = t.total() * 4 + trained * 12;
    std::printf("  %-22s %lld GPUs (%s GiB of model states / %s GiB, nothing else counted)\n", "bound without offload:",
                (long long)((states + hw.gpu_mem - 1) / hw.gpu_mem), gib(states).c_str(), gib(hw.gpu_mem).c_str());
  }
  for (bool off : {false, true}) {
    Candidate c;
    const int nodes = fewest_nodes(w, hw, off, &c);
    if (nodes < 0) std::printf("  %-22s none up to 4096 nodes\n", off ? "with optimizer offload:" : "no offload:");
    else
      std::printf("  %-22s %d node(s) = %d GPUs: %s, %s GiB per GPU, %s GiB host per node, step %.2f s\n",
                  off ? "with optimizer offload:" : "no offload:", nodes, nodes * hw.gpus_per_node,
                  c.layout.describe().c_str(), gib(c.gpu_need).c_str(), gib(c.host_node).c_str(), c.t_step);
  }
  return rc;
}

// ---- parallel.layout = "auto" ----

void choose_layout(Deck& d) {
  Runtime& rt = Runtime::get();
  Comm& world = rt.world();
  const Placement& p = rt.where();
  const bool cuda = d.str("model.backend") == "cuda";
  // The machine this job has: its ranks and nodes, the smallest device and host memory over the ranks.
  Hardware hw = gpu_preset("H200-141GB");  // speeds only rank layouts against each other
  hw.gpu = cuda ? "this GPU" : "CPU rank";
  hw.nodes = p.nodes;
  hw.gpus_per_node = int(world.max(p.local_size));
  const double host = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  hw.host_mem = int64_t(world.min(host));
  // CPU ranks: the "device" is the rank's share of the node's memory, which then holds the ZeRO shards already.
  double dev_mem = host / hw.gpus_per_node;
  if (!cuda) hw.host_mem = int64_t(1) << 62;
  if (cuda && dev::device_count() > 0) {
    dev::Exec ex = dev::make_exec(Device::CUDA, 0, std::max(0, p.gpu));
    size_t free_b = 0, total_b = 0;
    dev::memory_info(ex, &free_b, &total_b);
    dev::destroy_exec(ex);
    dev_mem = double(total_b);
  }
  hw.gpu_mem = int64_t(world.min(dev_mem));
  Workload w = workload_from_deck(d);
  if (!cuda) w.dt = DType::F32;
  std::vector<Candidate> cs = plan_candidates(w, hw);
  // Only what train runs (expert parallelism on CPU ranks only), and no offload: that is the deck's choice, of host
  // memory the job may not own alone.
  cs.erase(std::remove_if(cs.begin(), cs.end(),
                          [&](const Candidate& c) { return c.layout.offload || c.layout.ep > 1 || (cuda && !c.built); }),
           cs.end());
  if (cs.empty() || !cs.front().fits) {
    const std::string why = cs.empty() ? "no layout is built for this job" : cs.front().why;
    fail_all("parallel.layout = \"auto\": no layout fits " + std::to_string(hw.ranks()) + " rank(s) here (" + why +
             "); run `q3vl plan` on this deck with plan.* for the machine to see what would");
  }
  const Candidate& c = cs.front();
  int n_fit = 0;
  for (const Candidate& x : cs) n_fit += x.fits;
  d.set("parallel.zero_stage", std::to_string(c.layout.stage));
  d.set("parallel.hybrid", c.layout.hybrid ? "true" : "false");
  d.set("train.micro_batch", std::to_string(c.layout.micro_batch));
  d.set("train.recompute", c.layout.recompute ? "block" : "none");
  const std::string unit = cuda ? "GPU" : "rank";
  log_info("parallel.layout = auto: " + c.layout.describe() + " for " + std::to_string(hw.ranks()) + " rank(s) on " +
           std::to_string(hw.nodes) + " node(s): the fastest predicted of " + std::to_string(n_fit) +
           " built layouts that fit" + (cuda ? " (" + fmt("%.3g", c.t_step) + " s a step)" : " (CPU ranks: ranked by "
           "the planner's GPU time model, only the order counts)") + "; it needs " + gib(c.gpu_need) + " GiB per " +
           unit + " of " + gib(hw.gpu_mem) + (cuda ? ", " + gib(c.host_node) + " GiB host per node of " +
           gib(hw.host_mem) : std::string()) + (c.layout.recompute ? "; recomputation: the faster layouts without it do not fit" : ""));
}

}  // namespace q3vl
