// The training loop. Per optimizer step: the loader hands this rank its packed micro-batches; the step's
// supervised target count is all-reduced first so that each micro-batch's gradient is scaled by
// (its targets / the step's targets) and the step's loss is the mean over every supervised token of the global
// batch however it is split over ranks and micro-steps; the ZeRO engine gathers weights and reduce-scatters
// gradients; AdamW updates the fp32 shards after global-norm clipping; non-finite steps are skipped.
#include "q3vl/train/train.hpp"

#include <mpi.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <utility>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "q3vl/core/debug.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/data/shards.hpp"
#include "q3vl/io/checkpoint.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/runtime/stop.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/batch.hpp"
#include "q3vl/parallel/expert.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/runtime/watchdog.hpp"
#include "q3vl/tensor/profile.hpp"
#include "q3vl/train/dev_trainer.hpp"
#include "q3vl/train/flops.hpp"
#include "q3vl/train/loader.hpp"
#include "q3vl/train/optim.hpp"

#ifndef Q3VL_GIT
#define Q3VL_GIT "unknown"
#endif

namespace q3vl {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

struct TrainState {
  int64_t step = 0;            // optimizer steps taken (applied or skipped)
  int64_t adam_t = 0;          // updates applied (AdamW bias correction)
  int64_t tokens = 0;          // tokens seen
  int64_t skipped_total = 0, skipped_in_row = 0;
  double wall = 0;             // seconds of training before this job (earlier jobs of the run)
  double loss_scale = 0;       // fp16 dynamic loss scale (0: none)
  LoaderCursor cursor;
};

std::string to_json(const TrainState& s, int world, int stage, int ep) {
  json j = {{"step", s.step},
            {"schedule_step", s.step},
            {"adam_t", s.adam_t},
            {"tokens", s.tokens},
            {"skipped_total", s.skipped_total},
            {"skipped_in_row", s.skipped_in_row},
            {"wall", s.wall},
            {"loss_scale", s.loss_scale},
            {"cursor", {{"epoch", s.cursor.epoch}, {"position", s.cursor.position}}},
            {"world_size", world},
            {"zero_stage", stage},
            {"expert_parallel", ep}};  // for the record: any EP degree resumes any checkpoint
  return j.dump();
}

TrainState from_json(const std::string& text, const std::string& path) {
  try {
    json j = json::parse(text);
    TrainState s;
    s.step = j.at("step");
    s.adam_t = j.at("adam_t");
    s.tokens = j.at("tokens");
    s.skipped_total = j.at("skipped_total");
    s.skipped_in_row = j.at("skipped_in_row");
    s.wall = j.value("wall", 0.0);  // absent in checkpoints written before it was kept
    s.loss_scale = j.value("loss_scale", 0.0);
    s.cursor.epoch = j.at("cursor").at("epoch");
    s.cursor.position = j.at("cursor").at("position");
    return s;
  } catch (const std::exception& e) {
    fail_all("checkpoint '" + path + "': training state is unreadable: " + e.what());
  }
}

// LoRA: which base the adapters were trained on. A sum over elements (ckpt_checksum) weighted per tensor, so each
// rank adds its own shard and any rank count gets the same number; rank 0's value is the one written.
std::string lora_base_identity(const ZeroShards& e, Comm& shard, bool on) {
  if (!on) return "";
  uint64_t h = 0;
  for (const ShardPiece& p : e.pieces())
    if (!p.trainable) h += (2 * uint64_t(p.param) + 1) * ckpt_checksum(p.master, p.begin, p.count);
  int64_t v = int64_t(h);
  shard.all_reduce(&v, 1, DType::I64);  // wraps mod 2^64 like the sum it stands for
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)v);
  return buf;
}

std::string with_lora(const std::string& state_json, const LoraConfig& c, const std::string& base_id) {
  if (!c.on()) return state_json;
  json j = json::parse(state_json);
  j["lora"] = {{"rank", c.rank}, {"alpha", c.alpha}, {"rslora", c.rslora}, {"dropout", c.dropout},
               {"targets", c.targets}, {"base", base_id}};
  return j.dump();
}

// A LoRA checkpoint holds the adapters only: resuming them on another base (or with another scale) would train on
// silently, so it is refused, naming what differs.
void check_lora_resume(const std::string& state_json, const std::string& path, const LoraConfig& c,
                       const std::string& base_id) {
  json j;
  try {
    j = json::parse(state_json);
  } catch (const std::exception& e) {
    fail_all("checkpoint '" + path + "': training state is unreadable: " + e.what());
  }
  const bool had = j.contains("lora");
  if (had != c.on())
    fail_all("checkpoint '" + path + "' " + (had ? "holds LoRA adapters but lora.rank = 0 here"
                                                 : "is a full fine-tuning checkpoint but lora.rank > 0 here") +
             ": resume with the deck it was written with (or train.resume = never)");
  if (!had) return;
  const json& l = j["lora"];
  if (l.value("base", "") != base_id)
    fail_all("checkpoint '" + path + "' holds adapters trained on another base model (base weights fingerprint " +
             l.value("base", std::string("?")) + ", this run's model.hf gives " + base_id +
             "): resume against the base it was trained on");
  if (l.value("alpha", 0.0) != c.alpha || l.value("rslora", false) != c.rslora)
    fail_all("checkpoint '" + path + "': lora.alpha/lora.rslora differ from the run that wrote it (alpha " +
             std::to_string(l.value("alpha", 0.0)) + (l.value("rslora", false) ? ", rslora" : "") + ")");
}

// Every rank lists every tensor in the same order (the checkpoint calls are collective); a rank's slice of a
// tensor is its shard's intersection with it (count 0 where none, or when it is not this group's writer).
std::vector<CkptSlice> ckpt_slices(const ZeroShards& e, const ParamTable& t, const std::vector<bool>& trainable,
                                   bool mine) {
  std::vector<const ShardPiece*> piece(t.params().size(), nullptr);
  for (const ShardPiece& p : e.pieces()) piece[size_t(p.param)] = &p;
  std::vector<CkptSlice> out;
  enum { Master, ExpAvg, ExpAvgSq };
  const std::pair<int, const char*> kinds[] = {{Master, "model/"}, {ExpAvg, "optim/exp_avg/"},
                                               {ExpAvgSq, "optim/exp_avg_sq/"}};
  for (const auto& [kind, prefix] : kinds) {
    for (size_t i = 0; i < t.params().size(); ++i) {
      if (kind != Master && !trainable[i]) continue;  // frozen tensors have no optimizer state
      if (t.config().lora.on() && !trainable[i]) continue;  // LoRA: the base comes from model.hf, not the checkpoint
      CkptSlice s;
      s.dataset = prefix + t.param(int(i)).name;
      s.shape = t.param(int(i)).shape;
      if (const ShardPiece* p = piece[i]; p && mine) {
        s.begin = p->begin;
        s.count = p->count;
        s.data = kind == Master ? p->master : kind == ExpAvg ? p->exp_avg : p->exp_avg_sq;
      }
      out.push_back(std::move(s));
    }
  }
  return out;
}

// parallel.offload_optimizer = "cpu": the node must hold its ranks' host bytes, the largest rank's times the ranks (the
// host engine's shards that train keeps on every path, `engine`, where the optimizer updates the masters and moments
// in place; the trainer's own sizing, `need`: the pinned staging), checked against MemAvailable before anything is
// allocated. Collective over the world.
void check_offload_memory(Runtime& rt, const DevTrainerMemory& need, const ZeroMemory& engine) {
  Comm& node = rt.node_comm();
  const double mine = double(need.host() + engine.state());
  const double want = node.sum(mine), have = double(available_memory());
  const double GiB = double(int64_t(1) << 30);
  std::string err;
  if (want > have && node.rank() == 0) {
    char buf[640];
    std::snprintf(buf, sizeof buf,
                  "parallel.offload_optimizer = \"cpu\" needs %.1f GiB of host memory per node (%d rank(s) here, the "
                  "largest: fp32 masters %.1f GiB, AdamW moments %.1f GiB, pinned staging %.1f GiB), this node (%s) "
                  "has %.1f GiB available (MemAvailable); use more nodes or fewer ranks a node (`q3vl plan` sizes it)",
                  want / GiB, node.size(), double(engine.master + need.zero.host_master) / GiB,
                  double(engine.exp_avg + engine.exp_avg_sq + need.zero.host_moments) / GiB,
                  double(need.zero.host_staging) / GiB,
                  rt.where().host.c_str(), have / GiB);
    err = buf;
  }
  // The first refusing node's message, on every rank.
  Comm& world = rt.world();
  const int who = int(world.min(err.empty() ? double(world.size()) : double(world.rank())));
  if (who == world.size()) return;
  world.broadcast_string(err, who);
  fail_all(err);
}

double peak_rss_mib() {
  struct rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;  // KiB on Linux
}

double rss_mib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

std::string hms(double s) {
  const long t = long(std::max(0.0, s) + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  return buf;
}

// Seconds since `t0`, added to `acc`; the watchdog names the phase in its messages.
struct Phase {
  double& acc;
  double t0 = wall_seconds();
  Phase(double& acc, const char* name) : acc(acc) { Comm::set_phase(name); }
  ~Phase() { acc += wall_seconds() - t0; }
};

// Checkpoint I/O is collective HDF5 on the raw communicator, blocking inside MPI-IO where Comm::wait's deadline
// cannot reach: a timed barrier first names a rank that does not arrive, and the liveness watchdog (Blocking)
// ends the job if a rank stops in the middle.
template <class F>
auto guarded_io(Comm& world, const char* phase, const std::string& what, F&& f) {
  Comm::set_phase(phase);
  world.barrier();
  Blocking guard(what);
  return f();
}

}  // namespace

// The model, and the config.json text that checkpoints keep: model.hf's file unchanged (nothing it says is
// lost), else the preset's.
ModelConfig model_config(const Deck& d, std::string* json_text) {
  ModelConfig c;
  if (!d.str("model.hf").empty()) {
    c = load_hf_config(d.str("model.hf") + "/config.json", json_text);
  } else if (!d.str("model.preset").empty()) {
    c = preset_config(d.str("model.preset"));
    *json_text = hf_config_json(c);
  } else {
    fail_all("train needs model.hf (a Hugging Face directory) or model.preset (random init)");
  }
  const bool theta = override_rope_theta(c, d.real("model.rope_theta"));
  if (cut_depth(c, d.integer("model.text_layers"), d.integer("model.vision_layers")) || theta)
    *json_text = hf_config_json(c);  // what the checkpoints' model is: the cut one, its rotary
  c.lora = lora_config(d);
  return c;
}

std::vector<bool> trainable_flags(const ParamTable& t, const Deck& d) {
  if (t.config().lora.on()) {  // the adapters, and nothing else: the base is frozen whatever train.tune_* say
    std::vector<bool> out;
    for (const auto& p : t.params()) out.push_back(p.part == Part::Lora);
    return out;
  }
  const bool v = d.boolean("train.tune_vision"), m = d.boolean("train.tune_merger"), l = d.boolean("train.tune_llm");
  std::vector<bool> out;
  for (const auto& p : t.params()) out.push_back(p.part == Part::Vision ? v : p.part == Part::Merger ? m : l);
  if (std::none_of(out.begin(), out.end(), [](bool b) { return b; }))
    fail_all("train.tune_vision, train.tune_merger and train.tune_llm are all false: nothing to train");
  return out;
}

// Which checkpoints a run may resume from (newest first; empty: a fresh run) and the run's id. Decided on rank 0
// before anything is allocated. A folder holding checkpoints of another run (a fresh run into a used out_dir, or a
// resume whose folder also holds someone else's files) is refused: their rotation and `latest` would mix, and the
// next resume = auto would continue whichever run has the highest step. checkpoint.overwrite = true moves them
// aside instead.
struct ResumePlan {
  std::vector<std::string> candidates;
  std::string run_id;
};
// The checkpoint folder carries the run's tokenizer, so that serve.checkpoint=DIR needs nothing else (generate's
// tokenizer_file looks there): copied once per job (replacing another run's that differs), through a temporary name,
// never half-written. Without one (a tokenizer.path that does not exist: the synthetic dataset needs none) a warning
// says so.
bool same_bytes(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (fs::file_size(a, ec) != fs::file_size(b, ec) || ec) return false;
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  return std::equal(std::istreambuf_iterator<char>(fa), {}, std::istreambuf_iterator<char>(fb));
}
void carry_tokenizer(const Deck& deck, const std::string& ckdir) {
  static std::string carried;
  const std::string src = deck.str("tokenizer.path"), dst = ckdir + "/tokenizer.json";
  if (carried == dst) return;
  carried = dst;
  std::error_code ec;
  if (!fs::is_regular_file(src, ec)) {
    log_warn("checkpoint: tokenizer.path '" + src + "' is not a file: the checkpoints carry no tokenizer");
    return;
  }
  if (fs::exists(dst, ec) && same_bytes(src, dst)) return;
  const std::string tmp = dst + ".partial";
  if (fs::copy_file(src, tmp, fs::copy_options::overwrite_existing, ec)) fs::rename(tmp, dst, ec);
  if (ec) log_warn("checkpoint: could not copy the tokenizer to " + dst + ": " + ec.message());
}

ResumePlan plan_resume(const Deck& deck, const std::string& ckdir, Comm& world) {
  ResumePlan p;
  std::string err;
  if (world.rank() == 0) try {
      const std::string resume = deck.str("train.resume");
      std::vector<std::string> notes;
      if (resume == "auto") p.candidates = resume_candidates(ckdir, &notes);
      else if (resume != "never") p.candidates = {resume};
      for (const auto& n : notes) log_info("resume: " + n);
      if (p.candidates.empty()) {
        char id[17];
        std::snprintf(id, sizeof id, "%016llx", (unsigned long long)std::random_device{}() << 32 ^ std::random_device{}());
        p.run_id = id;
      } else {
        p.run_id = read_checkpoint_meta(p.candidates.front()).run_id;
      }
      if (const auto others = other_runs_checkpoints(ckdir, p.run_id); !others.empty()) {
        const std::string what = std::to_string(others.size()) + " checkpoint(s) of another run (" +
                                 fs::path(others.front()).filename().string() + (others.size() > 1 ? ", ..." : "") + ")";
        if (!deck.boolean("checkpoint.overwrite"))
          err = "checkpoint.dir '" + ckdir + "' holds " + what + ", and this run " +
                (p.candidates.empty() ? "starts afresh (train.resume = " + resume + ")" : "resumes " + p.candidates.front()) +
                ": its checkpoints would rotate and be resumed with those. Resume that run (train.resume = auto), "
                "write elsewhere (run.out_dir, checkpoint.dir), or set checkpoint.overwrite = true to move them aside";
        else
          log_warn("checkpoint.overwrite: " + what + " moved to " + move_checkpoints_aside(ckdir, others));
      }
    } catch (const Error& e) {
      err = e.what();
    }
  world.broadcast_string(err, 0);
  if (!err.empty()) fail_all(err);
  std::string packed;
  for (const auto& c : p.candidates) packed += c + '\n';
  world.broadcast_string(packed, 0);
  world.broadcast_string(p.run_id, 0);
  p.candidates.clear();
  for (size_t a = 0, b; (b = packed.find('\n', a)) != std::string::npos; a = b + 1) p.candidates.push_back(packed.substr(a, b - a));
  return p;
}

int run_train(const Deck& deck) {
  const double t_start = wall_seconds();  // metrics' time.wall counts start-up too
  Runtime& rt = Runtime::get();
  Comm& world = rt.world();
  const int rank = world.rank(), nranks = world.size();
  Comm::set_phase("start-up");
  const int stage = int(deck.integer("parallel.zero_stage"));
  const std::string out_dir = deck.str("run.out_dir");
  const std::string ckdir = deck.str("checkpoint.dir").empty() ? out_dir + "/checkpoints" : deck.str("checkpoint.dir");
  const uint64_t seed = uint64_t(deck.integer("run.seed"));
  const ResumePlan plan = plan_resume(deck, ckdir, world);

  std::string cfg_json;
  const ModelConfig cfg = model_config(deck, &cfg_json);
  if (!deck.str("model.hf").empty() && (deck.integer("model.text_layers") > 0 || deck.integer("model.vision_layers") > 0))
    fail_all("model.text_layers / model.vision_layers cut the depth of a model drawn at random (model.preset): "
             "model.hf's weights hold every layer, and loading a part of them is not supported");
  // The device model computes: on the rank's GPU (model.backend = "cuda") or on the CPU op layer ("cpu"). The host
  // keeps only the ZeRO engine's shards, for start-up and checkpoint I/O, in the device trainer's layout; no rank
  // ever holds a full host copy of the weights.
  const bool on_gpu = deck.str("model.backend") == "cuda";
  if (on_gpu && !deck.boolean("runtime.share_gpus")) {
    // One rank a GPU: NCCL refuses two ranks on one device, and sharing one is for tests, never fast.
    const Placement& p = rt.where();
    if (world.max(p.local_size > std::max(1, p.gpus_visible) ? 1 : 0) > 0)
      fail_all("model.backend = \"cuda\": " + std::to_string(p.local_size) + " ranks on node " + p.host + " but " +
               std::to_string(p.gpus_visible) + " GPU(s) visible: run one rank per GPU, or set runtime.share_gpus = "
               "true to let ranks share them (tests; each rank needs NCCL_HOSTID set to a value of its own)");
  }
  const DType compute = compute_dtype(deck.str("model.dtype"));  // app/modes.cpp checked it fits the backend
  // Expert parallelism: this rank's model holds only its experts; the exchange moves tokens to the others'.
  const int ep_size = int(deck.integer("parallel.ep"));
  if (const std::string e = expert_layout_error(cfg, nranks, ep_size); !e.empty()) fail_all(e);
  if (ep_size > 1 && deck.boolean("parallel.hybrid"))
    fail_all("parallel.ep > 1 with parallel.hybrid = true is not supported: shard over all ranks (hybrid = false)");
  std::unique_ptr<ExpertParallel> ep;
  if (ep_size > 1) ep = std::make_unique<ExpertParallel>(world, ep_size);
  const ParamTable table(cfg, ep ? ep->split() : ExpertSplit{});
  const bool aux_on = deck.boolean("train.router_aux_loss") && cfg.moe();
  const std::vector<bool> trainable = trainable_flags(table, deck);

  std::string base_id;  // LoRA: the frozen base's fingerprint, kept in checkpoints
  // Hybrid: shard over the node, replicate over the ranks with the same local rank on the other nodes.
  Comm* shard = &world;
  std::unique_ptr<Comm> replica;
  if (deck.boolean("parallel.hybrid")) {
    const Placement& p = rt.where();
    if (world.min(p.local_size) != world.max(p.local_size))
      fail_all("parallel.hybrid needs the same number of ranks on every node");
    shard = &rt.node_comm();
    replica = world.split(p.local_rank, p.node);
  }
  Offload offload;
  offload.optimizer = deck.str("parallel.offload_optimizer") == "cpu";
  offload.ring.threads = deck.integer("parallel.offload_threads") > 0 ? int(deck.integer("parallel.offload_threads"))
                                                                 : rank_cores(rt.where().local_size);
  offload.pin = deck.integer("parallel.offload_threads") == 0;
  offload.in_place = offload.optimizer;  // the engine's shards below
  offload.params = deck.str("parallel.offload_params") == "frozen";
  offload.delayed = deck.str("parallel.offload_update") == "delayed";
  offload.ring.chunk = deck.integer("parallel.offload_chunk");
  offload.ratio = deck.real("parallel.offload_ratio");
  if (offload.ratio < 1 && !offload.optimizer)
    fail_all("parallel.offload_ratio below 1 needs parallel.offload_optimizer = \"cpu\": it is "
             "the part of the update the host runs");
  if (offload.ratio < 1 && offload.params)
    fail_all("parallel.offload_ratio below 1 with parallel.offload_params = \"frozen\" is not "
             "supported: the device's part of the update needs the parameters on the device (use offload_ratio = 1)");
  if (offload.delayed && !offload.optimizer)
    fail_all("parallel.offload_update = \"delayed\" needs parallel.offload_optimizer = \"cpu\": it overlaps the "
             "host's AdamW with the next step");
  if (offload.delayed && offload.params)
    fail_all("parallel.offload_update = \"delayed\" with parallel.offload_params = \"frozen\" is not supported: "
             "the gathers would stream the masters the delayed update is changing (keep the parameters on the device)");
  // The rank's thread that drives the device keeps a core while the delayed update runs.
  if (offload.delayed && deck.integer("parallel.offload_threads") == 0) offload.ring.threads = std::max(1, offload.ring.threads - 1);
  if (offload.params && !offload.optimizer)
    fail_all("parallel.offload_params = \"frozen\" needs parallel.offload_optimizer = \"cpu\": the parameters are "
             "streamed from the fp32 masters, which only the offloaded optimizer keeps on the host");
  if (offload.params && std::all_of(trainable.begin(), trainable.end(), [](bool b) { return b; }))
    fail_all("parallel.offload_params = \"frozen\" but nothing is frozen (no LoRA adapters, lora.rank = 0, and every "
             "train.tune_* is true): keep the parameters on the device (parallel.offload_params = \"none\")");
  const bool in_bwd = deck.boolean("optim.update_in_backward");
  if (in_bwd) {
    auto needs = [&](bool ok, const std::string& what) {
      if (!ok) fail_all("optim.update_in_backward = true needs " + what);
    };
    char clip[32];
    std::snprintf(clip, sizeof clip, "%g", deck.real("optim.clip"));
    needs(deck.real("optim.clip") == 0, std::string("optim.clip = 0 (it is ") + clip +
                                            "): clipping scales every gradient by the global norm, which is known "
                                            "only after the whole backward");
    needs(stage == 3, "parallel.zero_stage = 3: a unit's gradient shard is final as the backward leaves the unit");
    needs(!offload.optimizer, "the optimizer on the device (parallel.offload_optimizer = \"none\")");
    needs(!replica, "parallel.hybrid = false: the replicas' gradient sum comes after the whole backward");
    needs(compute != DType::F16, "model.dtype other than fp16: dynamic loss scaling skips a whole step on overflow");
  }
  if (offload.optimizer) {
    const DevBudget b = train_budget(cfg, deck.integer("train.micro_batch"), deck.integer("data.seq_len"),
                                     deck.integer("train.max_patches"));
    const DevTrainerMemory need =
        DevTrainer::plan(cfg, compute, b, false, trainable, shard->size(), stage, on_gpu ? Device::CUDA : Device::CPU,
                         deck.str("parallel.gather_dtype") == "bf16", offload);
    ZeroMemory engine = ZeroShards::plan(table, shard->size(), 0, trainable);
    if (cfg.lora.on() && need.zero.host_params > 0) engine.master -= engine.frozen;  // released below
    check_offload_memory(rt, need, engine);
  }
  ZeroShards shards(table, *shard, trainable, ep.get());
  {
    // Each rank reads (HF files) or draws (seeded init) only its shard, straight into its master weights: no rank
    // ever holds the whole model. The values do not depend on the rank count.
    ScopedTimer t("train: init weights");
    const std::string hf = deck.str("model.hf"), adapter = deck.str("lora.adapter");
    std::vector<ParamSlice> base, lora;
    for (const ParamSlice& sl : shards.master_slices())
      (table.param(sl.param).part == Part::Lora ? lora : base).push_back(sl);
    const SliceBytes b = hf.empty() ? init_random_slices(table, seed, 0.02, base) : load_hf_slices(table, hf, base);
    if (!lora.empty() || cfg.lora.on()) {
      // A PEFT folder also replaces the base weights it carries (lm_head.base_layer.weight): after the base.
      const SliceBytes la = adapter.empty() ? init_random_slices(table, seed, 0.02, lora)
                                            : load_lora_slices(table, adapter, shards.master_slices());
      log_info("adapters: " + (adapter.empty() ? std::string("PEFT init (A kaiming-uniform, B zero)") : adapter) +
               ", " + std::to_string(la.mine) + " bytes on this rank");
    }
    base_id = lora_base_identity(shards, *shard, cfg.lora.on());
    char buf[256];
    std::snprintf(buf, sizeof buf, "weights: %s sharded %s, %.1f MiB on this rank (of %.1f MiB)",
                  hf.empty() ? ("random init (seed " + std::to_string(seed) + ")").c_str() : hf.c_str(),
                  hf.empty() ? "draw" : "read", double(b.mine) / (1 << 20), double(b.all) / (1 << 20));
    log_info(buf);
  }
  int64_t n_trainable = 0;
  for (size_t i = 0; i < trainable.size(); ++i) n_trainable += trainable[i] ? table.param(int(i)).numel : 0;
  log_info("model: " + std::to_string(table.total()) + " parameters in " + std::to_string(table.units().size()) +
           " ZeRO units, " + std::to_string(n_trainable) + " trained (vision " +
           (deck.boolean("train.tune_vision") ? "on" : "off") + ", merger " +
           (deck.boolean("train.tune_merger") ? "on" : "off") + ", llm " + (deck.boolean("train.tune_llm") ? "on" : "off") +
           "); activation recomputation: " + deck.str("train.recompute") + "; gathers in " +
           deck.str("parallel.gather_dtype") +
           (ep ? "; expert parallelism: " + std::to_string(ep_size) + " ranks a group, " +
                     std::to_string(table.experts_per_rank()) + " experts a rank, expert units sharded over " +
                     std::to_string(ep->replicas().size()) + " rank(s)"
               : std::string()));
  if (cfg.lora.on()) {
    const LoraSize ls = lora_size(cfg);
    char buf[320];
    std::snprintf(buf, sizeof buf,
                  "lora: rank %d, alpha %g%s, dropout %g, %lld linears wrapped, %lld adapter parameters (%.4f%% of "
                  "the %lld frozen); trained state (fp32 master, grad, 2 AdamW moments) %.2f MiB over all ranks, "
                  "full fine-tuning would be %.2f MiB",
                  cfg.lora.rank, cfg.lora.alpha, cfg.lora.rslora ? " (rsLoRA)" : "", cfg.lora.dropout,
                  (long long)ls.wrapped, (long long)ls.params, 100.0 * double(ls.params) / double(ls.base),
                  (long long)ls.base, double(ls.state_bytes()) / (1 << 20), double(ls.base * 16) / (1 << 20));
    log_info(buf);
    // What a checkpoint keeps (fp32 weights + 2 AdamW moments), in bytes: the demo-lora's comparison.
    const int64_t kept = ls.params * 12, full = ls.base * 12;
    std::snprintf(buf, sizeof buf,
                  "lora: adapters + AdamW state %lld bytes, full fine-tuning's weights + AdamW state %lld bytes "
                  "(%.0fx more)",
                  (long long)kept, (long long)full, double(full) / double(kept));
    log_info(buf);
  }

  // Data.
  const int64_t seq_len = deck.integer("data.seq_len");
  std::unique_ptr<Dataset> data;
  const int64_t syn_len = deck.integer("train.synthetic_len");  // 0: lengths spread over [seq_len/4, 5 seq_len/4]
  const int64_t syn_min = std::max<int64_t>(2, syn_len ? syn_len : seq_len / 4);
  const int64_t syn_max = syn_len ? syn_min : seq_len + seq_len / 4;
  if (deck.str("train.dataset") == "synthetic")
    data = std::make_unique<SyntheticDataset>(cfg, size_t(deck.integer("train.synthetic_samples")), seed,
                                              int(syn_min), int(syn_max),
                                              int(deck.integer("train.synthetic_image_px")),
                                              int(deck.integer("train.synthetic_image_every")));
  else
    data = std::make_unique<ShardDataset>(deck.str("train.dataset"));
  log_info("data: " + std::to_string(data->size()) + " samples from " + deck.str("train.dataset"));
  LoaderOptions lo;
  lo.global_batch = deck.integer("train.global_batch");
  lo.micro_batch = deck.integer("train.micro_batch");
  lo.grad_accum = deck.integer("train.grad_accum");
  {
    // A rank's samples of a micro-step: ceil(ceil(global_batch / ranks) / grad_accum). A larger micro_batch packs
    // the same micro-batches (each sample is at most seq_len tokens) and only sizes buffers that stay empty.
    const int64_t share = ((lo.global_batch + nranks - 1) / nranks + lo.grad_accum - 1) / lo.grad_accum;
    if (lo.micro_batch > share) {
      if (rank == 0)
        log_warn("train.micro_batch = " + std::to_string(lo.micro_batch) + " is more than the " + std::to_string(share) +
                 " sample(s) a rank gets per micro-step (train.global_batch = " + std::to_string(lo.global_batch) +
                 " over " + std::to_string(nranks) + " rank(s), train.grad_accum = " + std::to_string(lo.grad_accum) +
                 "): using " + std::to_string(share));
      lo.micro_batch = share;
    }
  }
  lo.seq_len = seq_len;
  lo.seed = seed;
  lo.drop_overlong = deck.str("data.overlong") == "drop";
  Loader loader(*data, cfg, lo, rank, nranks);

  // The device's arenas are sized once for the largest micro-batch the loader can make.
  std::unique_ptr<DevTrainer> trainer;
  {
    const DevBudget b = train_budget(cfg, lo.micro_batch, seq_len, deck.integer("train.max_patches"));
    LossScaling ls;
    ls.on = compute == DType::F16;
    ls.scale = deck.real("optim.loss_scale");
    ls.window = deck.integer("optim.loss_scale_window");
    trainer = std::make_unique<DevTrainer>(on_gpu ? Device::CUDA : Device::CPU, std::max(0, rt.where().gpu), cfg,
                                           trainable, compute, b, deck.str("train.recompute") == "block", ls, *shard,
                                           replica.get(), stage, deck.str("parallel.gather_dtype") == "bf16",
                                           ep.get(), [&] {
                                             Offload o = offload;
                                             o.state = offload.in_place ? &shards : nullptr;
                                             return o;
                                           }());
    if (in_bwd) trainer->enable_update_in_backward();
    log_info(trainer->memory_report());
  }

  // Resume: from the newest candidate whose tensors match their checksums; a corrupt one (its file intact, its
  // numbers not: every rank finds the same sums) is skipped with a warning, as a truncated one is.
  TrainState st;
  std::string path;
  for (size_t c = 0; c < plan.candidates.size() && path.empty(); ++c) {
    const std::string& cand = plan.candidates[c];
    ScopedTimer t("train: resume");
    std::string err;
    if (rank == 0) {
      // read_checkpoint refuses missing or reshaped tensors; this also refuses tensors this model lacks.
      try {
        for (const auto& [name, shape] : checkpoint_shapes(cand))
          if (table.find(name.substr(6)) < 0) {
            err = "checkpoint '" + cand + "' was written for a different model: it has tensor " + name +
                  ", which this model does not";
            break;
          }
      } catch (const Error& e) {
        err = e.what();
      }
    }
    world.broadcast_string(err, 0);
    if (!err.empty()) fail_all(err);
    const CkptMeta meta = read_checkpoint_meta(cand);
    check_lora_resume(meta.state_json, cand, cfg.lora, base_id);
    try {
      guarded_io(world, "checkpoint read", "checkpoint I/O on " + cand, [&] {  // names a reshaped tensor
        read_checkpoint(cand, MPI_COMM_WORLD, ckpt_slices(shards, table, trainable, true));
      });
    } catch (const Error& e) {
      const bool corrupt = e.collective() && std::string(e.what()).find("does not match its checksum") != std::string::npos;
      if (!corrupt || deck.str("train.resume") != "auto") throw;
      if (rank == 0)
        log_warn(std::string("resume: skipping ") + e.what() +
                 (c + 1 < plan.candidates.size() ? "; falling back to " + plan.candidates[c + 1] : "; starting afresh"));
      continue;  // the next candidate's read overwrites every tensor this one filled
    }
    // Same shapes but another computation (RoPE base, norm eps, token ids...): as wrong, and silent.
    if (!meta.hf_config_json.empty())
      if (const std::string d = config_difference(parse_hf_config(meta.hf_config_json, cand + ": hf_config_json"), cfg);
          !d.empty())
        fail_all("checkpoint '" + cand + "' was written for a different model configuration: " + d);
    st = from_json(meta.state_json, cand);
    loader.set_cursor(st.cursor);
    log_info("resumed from " + cand + " (step " + std::to_string(st.step) + ", written by " +
             std::to_string(meta.world_size) + " rank(s); now " + std::to_string(nranks) + ")");
    path = cand;
  }
  if (path.empty() && !plan.candidates.empty())  // every candidate corrupt: the weights must be drawn again
    fail_all("resume: no checkpoint in '" + ckdir + "' matches its checksums (see the warnings above); move them "
             "aside or set train.resume = never");
  trainer->from_host(shards);
  if (cfg.lora.on() && trainer->host_param_copy()) {
    // The base streams from the trainer's host copy in the compute dtype; LoRA checkpoints do not hold it.
    const int64_t b = shards.release_frozen();
    log_info("parallel.offload_params = \"frozen\": the frozen base's fp32 masters released (" +
             std::to_string(b >> 20) + " MiB on this rank); it streams from its " + deck.str("model.dtype") +
             " copy on the host");
  }
  if (st.loss_scale > 0) trainer->set_loss_scale(st.loss_scale);  // a resumed fp16 run keeps its scale
  {
    const double peak = peak_rss_mib();
    char buf[160];
    std::snprintf(buf, sizeof buf, "start-up done in %.1f s: peak RSS %.0f MiB on rank 0, %.0f MiB the largest rank",
                  wall_seconds() - t_start, peak, world.max(peak));
    log_info(buf);
  }

  const int64_t steps = deck.integer("train.steps");
  int64_t stop = steps;
  if (deck.integer("train.stop_after") > 0) stop = std::min(steps, st.step + deck.integer("train.stop_after"));
  Schedule sched;
  sched.kind = deck.str("optim.schedule");
  sched.lr = deck.real("train.lr");
  sched.min_lr_ratio = deck.real("optim.min_lr_ratio");
  sched.warmup = deck.integer("optim.warmup_steps");
  sched.total = steps;
  AdamWConfig hp;
  hp.beta1 = deck.real("optim.beta1");
  hp.beta2 = deck.real("optim.beta2");
  hp.eps = deck.real("optim.eps");
  hp.weight_decay = deck.real("optim.weight_decay");
  const double clip = deck.real("optim.clip");
  const int64_t every = deck.integer("checkpoint.every"), keep = deck.integer("checkpoint.keep");
  const int64_t nan_from = deck.integer("train.debug_nan_step"), nan_count = deck.integer("train.debug_nan_count");
  const int64_t max_skipped = deck.integer("train.max_skipped");
  const double walltime = deck.real("runtime.walltime");
  const double peak_flops = deck.real("runtime.peak_flops");
  const bool writer = !replica || replica->rank() == 0;
  const bool profile = deck.boolean("run.profile");
  const int64_t profile_step = deck.integer("run.profile_step");
  const bool profile_shapes = deck.boolean("run.profile_shapes");
  const int64_t profile_top = deck.integer("run.profile_top");
  const bool prefetch = deck.boolean("data.prefetch");

  std::FILE* metrics = nullptr;
  if (rank == 0) {
    fs::create_directories(out_dir);
    metrics = std::fopen((out_dir + "/metrics.jsonl").c_str(), "a");
    if (!metrics) fail("cannot open " + out_dir + "/metrics.jsonl for appending");
  }
  auto save = [&]() {
    ScopedTimer t("train: checkpoint");
    loader.quiesce();  // HDF5 is not thread-safe (no --enable-threadsafe build): no shard read beside the write
    trainer->to_host(shards);
    CkptMeta meta;
    meta.step = st.step;
    meta.tokens_seen = st.tokens;
    meta.world_size = nranks;
    meta.deck_toml = deck.to_toml(/*hide_secrets=*/true);
    meta.state_json = with_lora(to_json(st, nranks, stage, ep_size), cfg.lora, base_id);
    meta.build = std::string("q3vl git ") + Q3VL_GIT;
    meta.hf_config_json = cfg_json;
    meta.run_id = plan.run_id;
    const std::string p = guarded_io(world, "checkpoint write", "checkpoint I/O in " + ckdir, [&] {
      return write_checkpoint(ckdir, MPI_COMM_WORLD, meta, ckpt_slices(shards, table, trainable, writer), int(keep));
    });
    log_info("checkpoint " + p);
    if (world.rank() == 0) carry_tokenizer(deck, ckdir);
  };

  log_info("training steps " + std::to_string(st.step + 1) + ".." + std::to_string(stop) + " of " +
           std::to_string(steps) + ": global batch " + std::to_string(lo.global_batch) + " samples, " +
           std::to_string(nranks) + " rank(s), ZeRO stage " + std::to_string(stage));
  const double t_job = wall_seconds(), wall0 = st.wall;  // wall0: earlier jobs of this run, up to their checkpoint
  bool first_line = !path.empty();  // the first metrics line after a resume says so
  stop_init(walltime, out_dir);
  int64_t done = 0, last_saved = -1;
  while (st.step < stop) {
    Comm::set_step(long(st.step + 1));
    debug_stop_step(long(st.step + 1));
    const double t_step = wall_seconds();
    double t_data = 0, t_fwd = 0, t_bwd = 0, t_comm = 0, t_opt = 0;
    const bool profiling = profile && (profile_step == 0 || st.step + 1 == profile_step);
    if (profiling) prof::begin_step(trainer->exec(), profile_shapes);
    StepData sd;
    {
      Phase p{t_data, "data loading"};  // the wait for this step's batch: about nothing when it was prefetched
      sd = loader.next();
    }
    // The next step's batch is built on the loader's thread while this one computes (the host mostly waits for the
    // device or the collectives here). Not past the job's last step: nothing would read it.
    if (prefetch && st.step + 1 < stop) loader.prefetch();
    FlopCounts fc = count_flops(sd.micro);
    double counts[3 + FlopCounts::kFields] = {double(sd.supervised), double(sd.tokens), double(sd.dropped)};
    std::copy(fc.data(), fc.data() + FlopCounts::kFields, counts + 3);
    {
      Phase p{t_comm, "step counts"};
      world.all_reduce(counts, 3 + FlopCounts::kFields, DType::F64, ReduceOp::Sum);
    }
    std::copy(counts + 3, counts + 3 + FlopCounts::kFields, fc.data());
    const double n_global = counts[0];
    const int64_t step1 = st.step + 1;
    const double lr = sched.at(st.step);
    const bool poisoned = nan_from > 0 && step1 >= nan_from && step1 < nan_from + nan_count;
    trainer->begin_step();
    const int64_t gathered0 = trainer->gathered_bytes();
    double loss_sum = 0, aux_sum = 0;
    if (ep) ep->reset_stats();
    for (size_t i = 0; i < sd.micro.size(); ++i) {
      const int64_t n = sd.micro_supervised[i];
      // The last micro-step's backward updates each unit as it completes its gradient (optim.update_in_backward).
      if (in_bwd && i + 1 == sd.micro.size()) trainer->arm_update(hp, lr, st.adam_t + 1, poisoned);
      if (n == 0) {  // nothing to compute here, but the other ranks' collectives wait for this one's
        Phase p{t_comm, "ZeRO (a micro-batch without supervised tokens)"};
        trainer->idle();
        continue;
      }
      {
        Phase p{t_fwd, "forward"};
        // lora.dropout's mask: a new draw per (step, rank, micro-batch), the same again in a recomputed forward
        trainer->set_lora_draw(seed, (uint64_t(st.step) * uint64_t(nranks) + uint64_t(rank)) * 4096 + i);
        trainer->forward(sd.micro[i], aux_on);
        Q3VL_CHECK(trainer->supervised_tokens() == n, "the loader and the model count supervised targets differently");
      }
      Phase p{t_bwd, "backward"};  // with the LM head and the loss (DevTrainer::backward)
      double aux = 0;
      loss_sum += trainer->backward(n_global > 0 ? double(n) / n_global : 0.0, &aux) * double(n);
      aux_sum += aux * double(n);
    }
    double loss, gnorm;
    bool grads_finite = true;
    {
      Phase p{t_comm, "gradient reduction and loss"};
      trainer->finish_grads();
      loss = world.sum(loss_sum) / std::max(1.0, n_global);
    }
    DevTrainer::UnitUpdate uu;
    if (in_bwd) {
      Phase p{t_opt, "optimizer (the update's end: the units updated in the backward)"};
      uu = trainer->unit_update();
      gnorm = std::sqrt(uu.norm_sq), grads_finite = uu.skipped == 0;
    } else {
      Phase p{t_opt, "gradient norm"};
      gnorm = std::sqrt(trainer->grad_norm_sq(&grads_finite));
      if (poisoned) grads_finite = false, gnorm = NAN;
    }
    const bool finite = std::isfinite(loss) && std::isfinite(gnorm) && grads_finite;
    if (in_bwd && uu.skipped < uu.units) ++st.adam_t;  // some unit was updated, with t = adam_t + 1
    if (in_bwd && uu.skipped > 0)
      log_warn("step " + std::to_string(step1) + ": non-finite gradients in " + std::to_string(uu.skipped) + " of " +
               std::to_string(uu.units) + " trained units (" + uu.names +
               "): their update skipped, the other units updated (optim.update_in_backward)");
    if (finite) {
      if (!in_bwd) {
        Phase p{t_opt, "optimizer"};
        const double coef = clip > 0 && gnorm > clip ? clip / (gnorm + 1e-6) : 1.0;
        ++st.adam_t;
        trainer->update(hp, lr, coef, st.adam_t);
      }
      st.skipped_in_row = 0;
    } else {
      ++st.skipped_total;
      // fp16: an overflow of the scaled gradient is how dynamic loss scaling finds its scale, not a failing run.
      const bool scale_overflow =
          trainer->loss_scaling().on && std::isfinite(loss) && trainer->loss_scaling().scale > 1;
      if (!scale_overflow) ++st.skipped_in_row;
      if (scale_overflow)
        log_info("step " + std::to_string(step1) + ": fp16 gradients overflowed at loss scale " +
                 std::to_string(trainer->loss_scaling().scale) + ": step skipped, the scale halves");
      else if (in_bwd && !std::isfinite(loss))
        log_warn("step " + std::to_string(step1) + ": non-finite loss; " + std::to_string(uu.units - uu.skipped) +
                 " units with finite gradients were updated in the backward (optim.update_in_backward)");
      else if (!in_bwd)
        log_warn("step " + std::to_string(step1) + ": non-finite " + (std::isfinite(loss) ? "gradient norm" : "loss") +
                 " (loss " + std::to_string(loss) + ", grad norm " + std::to_string(gnorm) +
                 "): step skipped, weights and optimizer state unchanged");
      if (st.skipped_in_row >= max_skipped)
        fail_all("step " + std::to_string(step1) + ": " + std::to_string(st.skipped_in_row) +
                 " steps in a row had a non-finite loss or gradient (train.max_skipped = " +
                 std::to_string(max_skipped) + "); stopping. Lower train.lr or check the data; the last checkpoint" +
                 (last_saved >= 0 ? " is step " + std::to_string(last_saved) : " is the one this run started from"));
    }
    trainer->after_step(finite);
    st.loss_scale = trainer->loss_scaling().on ? trainer->loss_scaling().scale : 0;
    st.step = step1;
    st.tokens += int64_t(counts[1]);
    st.cursor = loader.cursor();
    ++done;

    const double dt = wall_seconds() - t_step;
    std::optional<prof::Report> report;  // rank 0's; reading the events waits for the step's device work
    if (profiling)
      report = prof::end_step(st.step, dt, {{"data", t_data}, {"forward", t_fwd}, {"backward", t_bwd},
                                           {"comm", t_comm}, {"optimizer", t_opt}},
                             profile_top > 0 ? size_t(profile_top) : SIZE_MAX);
    Timers& tm = Timers::get();
    tm.add("train: data", t_data), tm.add("train: forward", t_fwd), tm.add("train: backward", t_bwd);
    tm.add("train: comm", t_comm), tm.add("train: optimizer", t_opt);
    st.wall = wall0 + (wall_seconds() - t_start);
    const double elapsed = wall_seconds() - t_job, eta = elapsed / double(done) * double(stop - st.step);
    Comm::set_phase("metrics");
    const double rss = world.max(rss_mib());
    // Device memory by kind, the largest rank's, fixed at start-up: the activation arena, the ZeRO state and
    // shards, and the rest (the unit pool, the model's held weights and gradients, the workspace).
    const DevTrainerMemory m = trainer->memory();
    double mem[3] = {double(m.model.activations), double(m.zero.total() - m.zero.pool), 0};
    mem[2] = double(m.total()) - mem[0] - mem[1];
    world.all_reduce(mem, 3, DType::F64, ReduceOp::Max);
    // Load balance: rows (token, expert) that each rank's experts received this step, and the all-to-all time.
    double ep_stats[3] = {0, 0, 0};
    if (ep) {
      const double r = double(ep->received());
      ep_stats[0] = world.max(r), ep_stats[1] = world.min(r), ep_stats[2] = world.max(ep->seconds());
    }
    const double aux_mean = cfg.moe() ? world.sum(aux_sum) / std::max(1.0, n_global) : 0.0;
    if (rank == 0) {
      // MFU as DESIGN.md defines it; the inputs go next to it.
      const double flops = train_flops(table, fc);
      json j = {{"step", st.step},
                {"loss", loss},
                {"lr", lr},
                {"grad_norm", gnorm},
                {"tokens", int64_t(counts[1])},
                {"supervised_tokens", int64_t(n_global)},
                {"tokens_seen", st.tokens},
                {"tokens_per_s", counts[1] / dt},
                {"mfu", flops / dt / (peak_flops * nranks)},
                {"flops", {{"model", flops}, {"peak_per_rank", peak_flops}, {"ranks", nranks}, {"tokens", fc.tokens},
                           {"text_keys", fc.text_keys}, {"patches", fc.patches}, {"vision_keys", fc.vision_keys}}},
                {"time", {{"wall", st.wall}, {"step", dt}, {"data", t_data}, {"forward", t_fwd}, {"backward", t_bwd}, {"comm", t_comm},
                          {"optimizer", t_opt}, {"data_build", sd.build_seconds}}},
                {"rss_mib", rss},
                {"gathered_mib", double(trainer->gathered_bytes() - gathered0) / (1 << 20)},
                {"memory_mib", {{"activations", mem[0] / (1 << 20)}, {"zero_state", mem[1] / (1 << 20)},
                                {"working", mem[2] / (1 << 20)}}},
                {"skipped", !finite},
                {"skipped_total", st.skipped_total},
                {"dropped_samples", int64_t(counts[2])}};
      if (first_line) j["resumed"] = true;
      if (cfg.moe()) j["router_aux_loss"] = aux_mean;
      if (ep)
        j["experts"] = {{"ep", ep_size}, {"tokens_max", int64_t(ep_stats[0])}, {"tokens_min", int64_t(ep_stats[1])},
                        {"all_to_all_s", ep_stats[2]}};
      if (trainer->loss_scaling().on) j["loss_scale"] = trainer->loss_scaling().scale;
      if (report) j["profile"] = report->json();
      first_line = false;
      if (!finite) j["loss"] = std::isfinite(loss) ? json(loss) : json(nullptr), j["grad_norm"] = nullptr;
      std::fprintf(metrics, "%s\n", j.dump().c_str());
      std::fflush(metrics);
      char line[256];
      std::snprintf(line, sizeof line, "step %lld/%lld  loss %.6f  lr %.3e  gnorm %.4f  %.0f tok/s  rss %.0f MiB  ETA %s%s",
                    (long long)st.step, (long long)steps, loss, lr, gnorm, counts[1] / dt, rss, hms(eta).c_str(),
                    finite ? "" : "  (skipped)");
      log_info(line);
      if (report)
        for (const std::string& l : report->table()) log_info(l);
    }
    // A signal (Slurm's USR1 warning, SIGTERM), runtime.walltime or a STOP file: all ranks agree here.
    stop_note_step(dt);
    Comm::set_phase("stop check");
    std::string why;
    const bool stop_now = should_stop(world, &why) && st.step < stop;
    if ((every > 0 && st.step % every == 0) || st.step == stop || stop_now) {
      const double t_save = wall_seconds();
      save();
      stop_note_checkpoint(wall_seconds() - t_save);
      last_saved = st.step;
    }
    if (stop_now) {
      log_info("stopping early: " + why + "; checkpoint of step " + std::to_string(st.step) + " written");
      if (metrics) std::fclose(metrics);
      return stop_exit_status();  // 3: the job script requeues and the next job resumes here
    }
  }
  if (metrics) std::fclose(metrics);
  prof::release();
  log_info("training done: step " + std::to_string(st.step) + " of " + std::to_string(steps) + ", " +
           std::to_string(st.skipped_total) + " skipped step(s)");
  return 0;
}

}  // namespace q3vl
