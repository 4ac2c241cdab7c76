// The serving engine's model runner: the layout of the ranks (tensor-parallel groups, pipeline stages), the model's
// slice on each, its KV pools, and the step: rank 0's plan broadcast to the group, every rank's part, the logits (or
// greedy ids) back to rank 0. Every transfer runs under the collectives' watchdog (runtime.timeout).
#include "q3vl/serve/runner.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/runtime/nccl_comm.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/serve/generate.hpp"
#include "q3vl/serve/tp.hpp"

namespace q3vl {

bool is_watchdog(const Error& e) { return std::string_view(e.what()).starts_with("watchdog:"); }

namespace {
// A nonblocking MPI operation of the serving loop, waited on under comm's deadline (runtime.timeout): a rank that stops
// makes the wait fail naming the operation and the ranks behind, and the server ends (is_watchdog), instead of hanging
// in an unwatched MPI call, or going on with collectives out of step, which corrupted memory once the rank woke up.
// counted: a collective that every rank of comm starts (its sequence number names the ranks behind); a
// point-to-point transfer is not, and a stopped peer is named by its silence.
class MpiOp : public CommRequest {
 public:
  explicit MpiOp(const char* what) : CommRequest(what) {}
  bool test() override {
    int done = 0;
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    return done;
  }
  MPI_Request r = MPI_REQUEST_NULL;
};
template <class F>
void watched(Comm& c, const char* what, bool counted, F start) {
  auto op = std::make_unique<MpiOp>(what);
  if (counted) op->seq = c.begin_collective();
  start(&op->r);
  c.wait(std::move(op));
}

// The step plan's header, which the waiting ranks receive with short sleeps and no deadline (MPICH spins in a blocking
// broadcast, and a server waits for requests most of the time); rank 0 sends it under the watchdog.
void bcast_head(Comm& world, int64_t* buf, int n) {
  auto op = std::make_unique<MpiOp>("engine: step plan header (broadcast)");
  op->seq = world.begin_collective();
  MPI_Ibcast(buf, n, MPI_INT64_T, 0, MPI_COMM_WORLD, &op->r);
  if (world.rank() == 0) return world.wait(std::move(op));
  while (!op->test()) std::this_thread::sleep_for(std::chrono::microseconds(500));
}
}  // namespace

EngineConfig serve_config(const Deck& d) {
  EngineConfig c;
  c.budget = serve_budget(d);
  c.max_batch = d.integer("serve.max_batch");
  c.step_tokens = d.integer("serve.step_tokens");
  c.prefix_cache = d.boolean("serve.prefix_cache");
  c.timeout = d.real("serve.timeout");
  c.max_tpot = d.real("serve.max_tpot_ms") / 1000;
  c.vision_batch = d.boolean("serve.vision_batch");
  c.profile_steps = d.integer("serve.profile_steps");
  c.profile_rows = d.integer("serve.profile_rows");
  c.lower = "serve.max_context / serve.step_tokens / serve.max_batch";
  return c;
}

Runner::Runner(const Deck& d, const EngineConfig& c, BlockManager& blocks) : deck_(d), ec_(c), blocks_(blocks) {}

Runner::~Runner() {
  dev_.reset();
  tp_comm_.reset();  // after the model that sums through it, before the stream it runs on
  if (ex_.device == Device::CUDA) dev::destroy_exec(ex_);
}

std::unique_ptr<Comm> Runner::tp_mpi() const {
  auto c = std::make_unique<MpiComm>(tpc_);
  c->set_timeout(deck_.real("runtime.timeout"));
  return c;
}

template <class T>
void Runner::send(const T* p, size_t n, MPI_Datatype t, int to, int tag, const char* what) {
  watched(*world_c_, what, false, [&](MPI_Request* r) { MPI_Isend(p, (int)n, t, to, tag, MPI_COMM_WORLD, r); });
}
template <class T>
void Runner::recv(T* p, size_t n, MPI_Datatype t, int from, int tag, const char* what) {
  watched(*world_c_, what, false, [&](MPI_Request* r) { MPI_Irecv(p, (int)n, t, from, tag, MPI_COMM_WORLD, r); });
}

void Runner::log_tp() const {
  if (rank_ == 0 && pp_ > 1) {
    std::string st;
    for (int k = 0; k < pp_; ++k) {
      const DevStage s = DevStage::of(k, pp_, cfg_.text.layers);
      st += (k ? ", " : "") + std::to_string(s.l0) + "-" + std::to_string((s.l1 < 0 ? cfg_.text.layers : s.l1) - 1);
    }
    log_info(ec_.mode + ": pipeline of " + std::to_string(pp_) + " stages of " + std::to_string(tp_) +
             " rank(s) each, decoder layers " + st + " (stage 0 also the embeddings and vision tower, the last the head)");
  }
  if (rank_ != 0 || tp_ == 1) return;
  const TextConfig& t = cfg_.text;
  const std::string experts =
      t.num_experts == 0 ? ""
      : ep_ == 1         ? ", " + std::to_string(t.moe_intermediate) + " rows of every expert"
                         : ", " + std::to_string(t.num_experts / ep_) + " experts of " + std::to_string(t.num_experts) +
                       " (serve.ep = " + std::to_string(ep_) + ") with " + std::to_string(t.moe_intermediate) + " rows each";
  log_info(ec_.mode + ": tensor parallel over " + std::to_string(tp_) + " ranks: " + std::to_string(t.heads) +
           " query heads, " + std::to_string(t.kv_heads) + " key/value heads, " + std::to_string(t.intermediate) +
           " MLP rows" + experts + " and " + std::to_string(vocab_rows_.second - vocab_rows_.first) +
           " vocabulary rows per rank");
}

void Runner::load() {
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_);
  const ModelSource src = model_source(deck_, ec_.mode + ".checkpoint");
  const ServeLayout lay = serve_layout(world_, Runtime::get().where().nodes, (int)deck_.integer("serve.tp"),
                                       (int)deck_.integer("serve.pp"), src.cfg.text.layers);
  tp_ = lay.tp, pp_ = lay.pp, ep_ = (int)deck_.integer("serve.ep");
  if (rank_ == 0 && world_ > 1) log_info(lay.why);
  stage_ = rank_ / tp_, trank_ = rank_ % tp_;
  MPI_Comm_split(MPI_COMM_WORLD, stage_, trank_, &tpc_);
  world_c_ = std::make_unique<MpiComm>(MPI_COMM_WORLD);
  world_c_->set_timeout(deck_.real("runtime.timeout"));
  tpc_c_ = tp_mpi();
  checkpoint_ = src.checkpoint;
  if (pp_ > 1) dstage_ = DevStage::of(stage_, pp_, src.cfg.text.layers);  // serve_layout checked the stages
  // The model streams its weights (a rank's slice of them) from their source a unit at a time, so the host never
  // holds the fp32 model; adapters to fold need the whole model on the host first (fold_lora).
  std::unique_ptr<HostWeights> host;
  if (has_adapters(deck_, src)) {
    host = load_model(deck_, src);
    if (host->config().lora.on())  // a replicated LoRA term would be summed once per tensor-parallel rank
      host = fold_lora(*host, ec_.mode, ec_.mode == "serve" ? "serving" : "inference");
  }
  cfg_ = tp_config(host ? host->config() : src.cfg, trank_, tp_, ep_);  // fails naming serve.tp / serve.ep
  if (tp_ > 1) vocab_rows_ = tp_vocab_rows(cfg_.text.vocab, trank_, tp_);
  log_tp();
  build_model(src, std::move(host));
}

// The rank's slice goes to the device (model.backend = "cuda") in model.dtype, or stays on the CPU op layer in fp32
// ("cpu"), with the step buffers and KV pools of the budget (size_kv: its blocks, or what memory allows).
void Runner::build_model(const ModelSource& src, std::unique_ptr<HostWeights> host) {
  const Placement& where = Runtime::get().where();
  const bool on_cpu = deck_.str("model.backend") != "cuda";
  const DType dt = compute_dtype(deck_.str("model.dtype"));
  const QFormat quant = weight_quant(deck_);  // the decoder's linears, experts, an untied head
  ex_ = dev::make_exec(on_cpu ? Device::CPU : Device::CUDA, DevModel::kInferWorkspace, std::max(0, where.gpu));
  DevModel::InferBudget b = ec_.budget;
  if (!on_cpu) check_room(src, dt, quant);
  dev_ = std::make_unique<DevModel>(cfg_, ex_, dt, /*grads=*/false, dstage_, quant, DevHold{},
                                    tp_experts(trank_, tp_, ep_));
  dev_->set_graphs(deck_.boolean("model.cuda_graphs"));
  load_weights(src, std::move(host));
  const std::string sums = tp_ > 1 ? tensor_parallel(on_cpu, dt) : "";
  const std::string how = size_kv(b, on_cpu, dt);
  dev_->reserve_infer(b);
  blocks_.reset(b.block, b.kv_blocks, ec_.prefix_cache, world_ > 1);
  const DevMemory m = dev_->memory();
  const int64_t kv = DevModel::kv_pool_bytes(cfg_, dt, b.kv_blocks, b.block, dstage_);
  char msg[640];
  std::snprintf(msg, sizeof msg,
                "%s: on %s%s, %s%s%s%s: weights %s, step and vision buffers %s, KV cache %lld blocks of %lld tokens (%s, "
                "%lld tokens; %s)%s%s",
                ec_.mode.c_str(), on_cpu ? "the CPU op layer" : "GPU ",
                on_cpu ? "" : std::to_string(std::max(0, where.gpu)).c_str(), dtype_name(dt),
                quant != QFormat::None ? " with " : "", quant != QFormat::None ? qformat_name(quant) : "",
                quant != QFormat::None ? " linears" : "", bytes_text(double(m.weights)).c_str(),
                bytes_text(double(m.activations - kv)).c_str(), (long long)b.kv_blocks, (long long)b.block,
                bytes_text(double(kv)).c_str(), (long long)(b.kv_blocks * b.block), how.c_str(),
                tp_ > 1 ? " per rank" : "", sums.c_str());
  if (rank_ == 0) log_info(msg);
}

// Fits before anything is allocated: the slice's weights, the step buffers and the KV pool (one request's, when
// the pool takes what is left).
void Runner::check_room(const ModelSource& src, DType dt, QFormat quant) const {
  const DevModel::InferBudget& b = ec_.budget;
  const int gpu = std::max(0, Runtime::get().where().gpu);
  size_t free0 = 0, total0 = 0;
  dev::memory_info(ex_, &free0, &total0);
  const double w = double(DevModel::weight_bytes(ParamTable(cfg_, tp_experts(trank_, tp_, ep_)), dt, dstage_, quant));
  const double need = w + double(DevModel::infer_bytes(cfg_, dt, b, dstage_)) +
                      double(b.kv_blocks ? 0 : DevModel::kv_pool_bytes(cfg_, dt, b.seq_blocks, b.block, dstage_)) +
                      0.05 * double(total0);
  if (need <= double(free0)) return;
  // The weights split further over more ranks; the rest stays per rank.
  const double rest = need - w;
  const double whole = double(DevModel::weight_bytes(ParamTable(src.cfg), dt, {}, quant));
  const int ranks = std::max(world_ + 1, (int)std::ceil(whole / std::max(1.0, double(free0) - rest)));
  char msg[640];
  std::snprintf(msg, sizeof msg,
                "%s: rank %d needs %.1f GiB on GPU %d (its slice of the weights in %s %.1f GiB, step buffers and "
                "%s KV cache %.1f GiB, 5%% reserve), which has %.1f GiB free: run over about %d GPUs "
                "(mpiexec -n N; serve.tp x serve.pp = N), or lower %s%s",
                ec_.mode.c_str(), rank_, need / 1073741824.0, gpu, dtype_name(dt), w / 1073741824.0,
                b.kv_blocks ? "the" : "one request's", (rest - 0.05 * double(total0)) / 1073741824.0,
                double(free0) / 1073741824.0, ranks, ec_.lower.c_str(),
                dt == DType::F32 ? ", or model.dtype = \"bf16\"" : "");
  fail(msg);
}

// The rank's slice of the weights (tp_slices; all of them at one rank) a unit at a time: streamed from the source, or
// cut from a host model (adapters folded), which goes once the device holds its slice.
void Runner::load_weights(const ModelSource& src, std::unique_ptr<HostWeights> host) {
  const ParamTable full = host ? host->table() : ParamTable(src.cfg);
  const ParamTable& local = dev_->table();
  auto slices = [&](const UnitInfo& u, float* buf) {
    if (!DevModel::stage_owns(local, dstage_, int(&u - local.units().data()))) return std::vector<ParamSlice>{};
    return tp_slices(
        full, local, trank_, tp_,
        [&](int id) -> float* {
          const ParamInfo& p = local.param(id);
          return &local.units()[p.unit] == &u ? buf + p.offset : nullptr;
        },
        ep_);
  };
  auto sink = [&](int64_t off, const float* v, int64_t n) { dev_->set_params(off, v, n); };
  if (!host) {
    const bool ok = stream_weights(deck_, src, local, slices, sink);
    Q3VL_CHECK(ok, ec_.mode + ": these weights cannot be streamed");
    return;
  }
  std::vector<float> buf;
  for (const UnitInfo& u : local.units()) {
    if (!DevModel::stage_owns(local, dstage_, int(&u - local.units().data()))) continue;
    buf.resize(size_t(u.numel));
    for (const ParamSlice& p : slices(u, buf.data())) {
      const float* from = host->param(p.param) + p.begin;
      std::copy(from, from + p.count, p.dst);
    }
    sink(u.offset, buf.data(), u.numel);
  }
}

// The tensor-parallel group's sums (serve.tp_comm): NCCL on the device, else MPI through the host. Says which.
std::string Runner::tensor_parallel(bool on_cpu, DType dt) {
  const Placement& where = Runtime::get().where();
  std::string kind = deck_.str("serve.tp_comm");
  int own = where.local_size <= where.gpus_visible;  // every rank of the node on a GPU of its own
  MPI_Allreduce(MPI_IN_PLACE, &own, 1, MPI_INT, MPI_MIN, tpc_);
  if (kind == "auto") kind = own && !on_cpu ? "nccl" : "mpi";
  if (kind == "nccl" && on_cpu) fail("serve.tp_comm = \"nccl\" needs the model on GPUs (model.backend = \"cuda\")");
  tp_comm_ = kind == "nccl" ? make_nccl_comm(tpc_, ex_, deck_.real("runtime.timeout")) : tp_mpi();
  dev_->set_tensor_parallel(tp_comm_.get(), vocab_rows_.first, vocab_rows_.second);
  return kind == "nccl" ? "; tensor-parallel sums over NCCL " + nccl_version() + " in " + dtype_name(dt)
                        : "; tensor-parallel sums over MPI in fp32 through the host" +
                              std::string(own || on_cpu ? "" : " (ranks share a GPU)");
}

// The KV pool: the budget's blocks (generate: what its prompts need), or serve.kv_mib, or (0) what the device has
// left after the weights and the step buffers (on the CPU: half this rank's share of the available memory), at most
// what serve.max_batch x serve.max_context can use. Every rank gets the same blocks. Says how it was sized.
std::string Runner::size_kv(DevModel::InferBudget& b, bool on_cpu, DType dt) {
  if (b.kv_blocks > 0) return "what the prompts need, " + std::to_string(ec_.max_batch) + " at a time";
  const Placement& where = Runtime::get().where();
  const int64_t block = b.block, ctx = deck_.integer("serve.max_context");
  const int64_t per_block = DevModel::kv_pool_bytes(cfg_, dt, 1, block, dstage_);
  double kv_bytes = deck_.real("serve.kv_mib") * 1048576.0;
  std::string how = "serve.kv_mib";
  // Ranks that share a GPU (more ranks on the node than GPUs) split what it has left once all weights are in.
  size_t free_b = 0, total_b = 0;
  const int share = std::max(1, where.local_size / std::max(1, where.gpus_visible));
  MPI_Barrier(MPI_COMM_WORLD);
  if (!on_cpu) dev::memory_info(ex_, &free_b, &total_b);
  if (kv_bytes == 0) {
    const double need = double(ec_.max_batch) * double(ctx + block) * double(per_block) / double(block);
    // What is left after the weights (loaded), the workspace (made) and the step buffers, less 5% of the device for
    // cuBLAS and the allocator; on the CPU op layer, as the host backend sizes it.
    const double room = on_cpu ? 0.5 * double(available_memory()) / where.local_size
                               : (double(free_b) - 0.05 * double(total_b)) / share -
                                     double(DevModel::infer_bytes(cfg_, dt, b, dstage_));
    kv_bytes = std::max(0.0, std::min(need, room));
    how = kv_bytes == need ? "auto: what serve.max_batch x serve.max_context can use"
                           : (on_cpu ? "auto: half of this rank's share of the available memory"
                                     : "auto: the device memory left after the weights and step buffers");
  }
  MPI_Allreduce(MPI_IN_PLACE, &kv_bytes, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);  // every rank the same blocks
  b.kv_blocks = (int64_t)kv_bytes / per_block;
  if (b.kv_blocks < b.seq_blocks)
    fail("serve: room for " + std::to_string(b.kv_blocks) + " KV blocks of " + std::to_string(block) +
         " tokens, fewer than one request of serve.max_context = " + std::to_string(ctx) + " needs (" +
         std::to_string(b.seq_blocks) + "); lower serve.max_context, serve.step_tokens or serve.max_batch, raise "
         "serve.kv_mib, or add ranks (serve.tp)");
  return how;
}

void Runner::follow() {
  while (!stopped_) {
    std::vector<StepSegment<float>> segs;
    try {
      step(segs);
    } catch (const Error& e) {  // rank 0 met the same error in the same step and goes on
      if (is_watchdog(e)) throw;  // unless a rank stopped: then the job ends
    }
  }
}

void Runner::stop() {
  std::vector<StepSegment<float>> none;
  if (world_ > 1) step(none, true);
}

std::vector<float> Runner::step(std::vector<StepSegment<float>>& segs, bool stop, DevModel::Argmax* best) {
  if (world_ == 1) return dev_->step(segs, blocks_.cache(), nullptr, nullptr, best);  // blocks_ logged nothing
  DevModel::Argmax mine;  // a greedy step's on the other ranks
  if (!share_plan(segs, stop, best, mine)) return {};
  // A step that fails on one rank fails on all (same shapes, same cache state): the error stays collective.
  const std::vector<float> local = run_stage(segs, best);
  const int64_t ns = (int64_t)segs.size();
  if (stage_ + 1 < pp_) return rank_ == 0 ? from_last_stage(ns, best) : std::vector<float>{};
  if (best) {
    if (tp_ > 1) best_of_group(*best, ns);
    if (trank_ == 0 && rank_ != 0) send(best->id.data(), ns, MPI_INT32_T, 0, 2, "engine: argmax ids to rank 0");
    return {};
  }
  return logits_to_root(local, ns);
}

// The step plan, from rank 0 to every rank: ints [ops..., greedy (0, or 1 + banned count: limit, banned...), nseg,
// per segment: slot, n ids, ids, n pos, pos, img floats, ds count, ds floats...], floats [img, ds...]; a header
// [stop, ints, floats] first. The other ranks replay the block manager's changes and take the segments (and, for a
// greedy step, best = &mine). False when rank 0 said stop.
bool Runner::share_plan(std::vector<StepSegment<float>>& segs, bool stop, DevModel::Argmax*& best,
                        DevModel::Argmax& mine) {
  std::vector<int64_t> ints;
  std::vector<float> floats;
  int64_t head[3] = {stop ? 1 : 0, 0, 0};
  if (rank_ == 0) {
    const std::vector<int64_t> log = blocks_.take_log();
    ints.push_back((int64_t)log.size());
    ints.insert(ints.end(), log.begin(), log.end());
    ints.push_back(best ? 1 + (int64_t)best->banned.size() : 0);
    if (best) ints.push_back(best->limit), ints.insert(ints.end(), best->banned.begin(), best->banned.end());
    ints.push_back((int64_t)segs.size());
    for (const auto& g : segs) {
      ints.insert(ints.end(), {(int64_t)g.seq, (int64_t)g.ids.size()});
      ints.insert(ints.end(), g.ids.begin(), g.ids.end());
      ints.push_back((int64_t)g.pos3.size());
      ints.insert(ints.end(), g.pos3.begin(), g.pos3.end());
      ints.insert(ints.end(), {(int64_t)g.img.size(), (int64_t)g.ds.size()});
      floats.insert(floats.end(), g.img.begin(), g.img.end());
      for (const auto& d : g.ds) ints.push_back((int64_t)d.size()), floats.insert(floats.end(), d.begin(), d.end());
    }
    head[1] = (int64_t)ints.size(), head[2] = (int64_t)floats.size();
  }
  bcast_head(*world_c_, head, 3);
  if (head[0]) {
    stopped_ = true;
    return false;
  }
  ints.resize(head[1]);
  floats.resize(head[2]);
  world_c_->broadcast(ints.data(), ints.size(), DType::I64, 0);
  world_c_->broadcast(floats.data(), floats.size(), DType::F32, 0);
  if (rank_ == 0) return true;
  size_t i = 1, f = 0;
  const size_t ops_end = 1 + (size_t)ints[0];
  while (i < ops_end) i = BlockManager::apply(blocks_.cache(), ints, i);
  if (const int64_t g = ints[i++]) {
    mine.limit = ints[i++];
    mine.banned.assign(ints.begin() + i, ints.begin() + i + (g - 1)), i += g - 1;
    best = &mine;
  }
  segs.assign(ints[i++], {});
  for (auto& g : segs) {
    g.seq = (int)ints[i++];
    const int64_t n = ints[i++];
    g.ids.assign(ints.begin() + i, ints.begin() + i + n), i += n;
    const int64_t np = ints[i++];
    g.pos3.assign(ints.begin() + i, ints.begin() + i + np), i += np;
    const int64_t ni = ints[i++], nd = ints[i++];
    g.img.assign(floats.begin() + f, floats.begin() + f + ni), f += ni;
    for (int64_t d = 0; d < nd; ++d) {
      const int64_t nf = ints[i++];
      g.ds.emplace_back(floats.begin() + f, floats.begin() + f + nf), f += nf;
    }
  }
  return true;
}

// This rank's stage of the step: its layers on the previous stage's hidden states, which go on to the next stage
// (rank trank_ to rank trank_). The last stage returns its rows of the logits (or, greedy, its argmax in best).
std::vector<float> Runner::run_stage(const std::vector<StepSegment<float>>& segs, DevModel::Argmax* best) {
  std::vector<float> x, y;
  if (stage_ > 0) {
    int64_t N = 0;
    for (const auto& g : segs) N += (int64_t)g.ids.size();
    x.resize(N * cfg_.text.hidden);
    recv(x.data(), x.size(), MPI_FLOAT, rank_ - tp_, 1, "engine: hidden states from the previous stage");
  }
  std::vector<float> local = dev_->step(segs, blocks_.cache(), stage_ > 0 ? &x : nullptr, pp_ > 1 ? &y : nullptr, best);
  if (stage_ + 1 < pp_) send(y.data(), y.size(), MPI_FLOAT, rank_ + tp_, 1, "engine: hidden states to the next stage");
  return local;
}

// Rank 0 in a pipeline: the step's result from the last stage's first rank.
std::vector<float> Runner::from_last_stage(int64_t ns, DevModel::Argmax* best) {
  const int last0 = (pp_ - 1) * tp_;
  if (best) {
    best->id.resize(ns);
    recv(best->id.data(), ns, MPI_INT32_T, last0, 2, "engine: argmax ids from the last stage");
    return {};
  }
  std::vector<float> logits(ns * cfg_.text.vocab);
  recv(logits.data(), logits.size(), MPI_FLOAT, last0, 2, "engine: logits from the last stage");
  return logits;
}

// Each rank's best of its vocabulary rows: the group's first takes the best of those (ties: the lower id).
void Runner::best_of_group(DevModel::Argmax& best, int64_t ns) {
  std::vector<float> vals(trank_ == 0 ? ns * tp_ : 0);
  std::vector<int32_t> ids(vals.size());
  watched(*tpc_c_, "engine: argmax values (gather)", true, [&](MPI_Request* r) {
    MPI_Igather(best.val.data(), (int)ns, MPI_FLOAT, vals.data(), (int)ns, MPI_FLOAT, 0, tpc_, r);
  });
  watched(*tpc_c_, "engine: argmax ids (gather)", true, [&](MPI_Request* r) {
    MPI_Igather(best.id.data(), (int)ns, MPI_INT32_T, ids.data(), (int)ns, MPI_INT32_T, 0, tpc_, r);
  });
  if (trank_ != 0) return;
  for (int64_t s = 0; s < ns; ++s)
    for (int r = 0; r < tp_; ++r) {
      const float v = vals[r * ns + s];
      const int32_t id = ids[r * ns + s];
      int32_t& b = best.id[s];
      if (id >= 0 && (b < 0 || v > best.val[s] || (v == best.val[s] && id < b))) b = id, best.val[s] = v;
    }
}

// The last stage's logits [ns, V] to rank 0: the group's vocabulary slices gathered on its first rank.
std::vector<float> Runner::logits_to_root(const std::vector<float>& local, int64_t ns) {
  const int64_t V = cfg_.text.vocab;
  if (tp_ == 1) {  // the whole vocabulary already: no gather, no copies of [segs, V]
    if (rank_ == 0) return local;
    send(local.data(), local.size(), MPI_FLOAT, 0, 2, "engine: logits to rank 0");
    return {};
  }
  std::vector<int> counts(tp_), offs(tp_);
  for (int r = 0; r < tp_; ++r) {
    const auto [a, b] = tp_vocab_rows(V, r, tp_);
    counts[r] = (int)(ns * (b - a)), offs[r] = r ? offs[r - 1] + counts[r - 1] : 0;
  }
  std::vector<float> all(trank_ == 0 ? ns * V : 0);
  watched(*tpc_c_, "engine: logits (gather)", true, [&](MPI_Request* r) {
    MPI_Igatherv(local.data(), (int)local.size(), MPI_FLOAT, all.data(), counts.data(), offs.data(), MPI_FLOAT, 0, tpc_, r);
  });
  if (trank_ != 0) return {};
  std::vector<float> logits(ns * V);
  for (int r = 0; r < tp_; ++r) {  // rank r's block is [ns, its rows]
    const auto [a, b] = tp_vocab_rows(V, r, tp_);
    for (int64_t s = 0; s < ns; ++s)
      std::copy(&all[offs[r] + s * (b - a)], &all[offs[r] + (s + 1) * (b - a)], &logits[s * V + a]);
  }
  if (rank_ != 0) {  // the last stage's first rank: the logits to the engine
    send(logits.data(), logits.size(), MPI_FLOAT, 0, 2, "engine: logits to rank 0");
    return {};
  }
  return logits;
}

}  // namespace q3vl
