// Model assembly on the device op layer (spec 1-5), the same sequence as the test reference's host model
// (tests/reference/qwen3vl.cpp).
// Host work per forward is the small metadata only: token ids, targets, segment offsets, rotary tables, the rows of
// image tokens and of supervised targets, uploaded once into buffers carved at reserve().
#include "q3vl/model/dev_model.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include "q3vl/core/debug.hpp"
#include "q3vl/core/env.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/core/parallel.hpp"
#include "q3vl/model/dev_vision.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

namespace {
// LM-head chunk: [rows, V] logits (and their gradient) exist at a time, never [N, V]. 1024 rows, or
// Q3VL_HEAD_ROWS=n (n >= 1; for A/B runs of the chunk's GEMM shape against its memory).
int64_t head_chunk_rows() {
  static const int64_t r = env_positive("Q3VL_HEAD_ROWS", 1024);
  return r;
}

int64_t moe_layers(const ModelConfig& cfg) {
  const ParamTable t(cfg);
  int n = 0;
  for (int l = 0; l < cfg.text.layers; ++l) n += t.moe_layer(l);
  return n;
}
}  // namespace

DType compute_dtype(const std::string& name) {
  if (name == "fp32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "fp16") return DType::F16;
  fail_all("model.dtype = \"" + name + "\": expected fp32, bf16 or fp16");
}

struct DevModel::Impl {
  DevBudget b;
  bool recompute = false;
  // Recomputation: each block's input [T,H] / [P,Dv], and one full context per kind of block that reruns.
  std::vector<void*> dxin, vxin;
  DevDecoderCtx dwork[2];  // [0] dense, [1] MoE
  DevVisionBlockCtx vwork;
  int64_t head_rows = 0;
  void* block = nullptr;  // the arena's memory
  size_t bytes = 0;
  // Kept for backward.
  std::vector<DevDecoderCtx> dctx;
  DevDecoderScratch dscr;
  std::vector<DevVisionBlockCtx> vctx;
  DevVisionScratch vscr;
  DevMergerCtx mctx;
  std::vector<DevMergerCtx> dsctx;
  DevMergerScratch mscr;
  // Batch metadata (device).
  int32_t *ids, *cu, *vis, *sup, *sup_t, *head_t, *vcu, *pos, *vpos;
  float *tcos, *tsin, *vcos, *vsin;
  // Streams and gradients (dt unless noted).
  void *x, *hf, *dh, *dx, *hb, *lg, *dlg, *dhb, *pixels, *vx, *dv, *img, *dimg;
  std::vector<void*> ds, dds;
  DevLora lora;  // adapters' run state and scratch (nothing carved without adapters)
  float *rf, *rowloss, *probs, *aux_f;
  int32_t* idx;
  void* aux_dl;
  double* sums;  // [0] CE sum, [1] aux sum
  std::vector<uint16_t> stage;  // the pixels in bf16 / fp16 on their way up (reused: no fresh pages every step)
  // Host copies of the last forward's metadata.
  TokenStream st;
  std::vector<int64_t> grid;
  int64_t N = 0, nvis = 0, nsup = 0, Np = 0, nseg = 0, max_len = 0, vseg = 0, vmax = 0;

  // Carves everything in a fixed order; with a counting arena it only sizes.
  void carve(Arena& a, const ModelConfig& cfg, DType dt) {
    const TextConfig& tc = cfg.text;
    const VisionConfig& vc = cfg.vision;
    const ParamTable t(cfg);
    const int64_t T = std::max<int64_t>(b.tokens, 1), H = tc.hidden, V = tc.vocab, P = b.patches, Pm = P / 4;
    const int64_t nmoe = moe_layers(cfg), E = tc.num_experts, K = tc.experts_per_tok;
    const size_t nds = vc.deepstack_indexes.size();
    head_rows = std::min(T, head_chunk_rows());
    dctx.assign(recompute ? 0 : tc.layers, {});
    for (int l = 0; l < int(dctx.size()); ++l) dctx[l].carve(a, tc, t.moe_layer(l), T, dt, b.ep);
    dxin.assign(recompute ? tc.layers : 0, nullptr);
    for (auto& p : dxin) p = a.take(T * H, dt);
    if (recompute) {
      bool kinds[2] = {false, false};
      for (int l = 0; l < tc.layers; ++l) kinds[t.moe_layer(l)] = true;
      for (int m = 0; m < 2; ++m)
        if (kinds[m]) dwork[m].carve(a, tc, m == 1, T, dt, b.ep);
    }
    dscr.carve(a, tc, nmoe > 0, T, dt, b.ep);
    ids = a.take<int32_t>(T, DType::I32), cu = a.take<int32_t>(b.segments + 1, DType::I32);
    vis = a.take<int32_t>(T, DType::I32), sup = a.take<int32_t>(T, DType::I32), sup_t = a.take<int32_t>(T, DType::I32);
    head_t = a.take<int32_t>(T, DType::I32), pos = a.take<int32_t>(3 * T, DType::I32);
    tcos = a.take<float>(T * tc.head_dim / 2, DType::F32), tsin = a.take<float>(T * tc.head_dim / 2, DType::F32);
    x = a.take(T * H, dt), hf = a.take(T * H, dt), dh = a.take(T * H, dt), dx = a.take(T * H, dt);
    hb = a.take(head_rows * H, dt), dhb = a.take(head_rows * H, dt);
    lg = a.take(head_rows * V, dt), dlg = a.take(head_rows * V, dt);
    rf = a.take<float>(T, DType::F32), rowloss = a.take<float>(head_rows, DType::F32);
    probs = a.take<float>(std::max<int64_t>(1, nmoe * T * E), DType::F32);
    idx = a.take<int32_t>(std::max<int64_t>(1, nmoe * T * K), DType::I32);
    aux_dl = a.take(std::max<int64_t>(1, nmoe * T * E), DType::F32);  // F32: the router's gradient (dev_decoder_bwd)
    aux_f = a.take<float>(std::max<int64_t>(1, E), DType::F32);
    sums = a.take<double>(2, DType::F64);
    lora.carve(a, cfg, T, P, dt);
    // Vision tower (only when the budget has patches).
    vctx.assign(P && !recompute ? vc.depth : 0, {});
    vxin.assign(P && recompute ? vc.depth : 0, nullptr);
    dsctx.assign(P ? nds : 0, {});
    ds.assign(nds, nullptr), dds.assign(nds, nullptr);
    pixels = vx = dv = img = dimg = nullptr, vcos = vsin = nullptr, vcu = vpos = nullptr;
    if (!P) return;
    for (auto& c : vctx) c.carve(a, vc, P, dt);
    for (auto& p : vxin) p = a.take(P * vc.hidden, dt);
    if (recompute) vwork.carve(a, vc, P, dt);
    vscr.carve(a, vc, P, dt);
    mctx.carve(a, vc, false, P, dt);
    for (auto& c : dsctx) c.carve(a, vc, true, P, dt);
    mscr.carve(a, vc, P, dt);
    pixels = a.take(P * vc.patch_dim(), dt), vx = a.take(P * vc.hidden, dt), dv = a.take(P * vc.hidden, dt);
    img = a.take(Pm * H, dt), dimg = a.take(Pm * H, dt);
    for (size_t j = 0; j < nds; ++j) ds[j] = a.take(Pm * H, dt), dds[j] = a.take(Pm * H, dt);
    vcos = a.take<float>(P * vc.head_dim() / 2, DType::F32), vsin = a.take<float>(P * vc.head_dim() / 2, DType::F32);
    vcu = a.take<int32_t>(Pm + 1, DType::I32);  // a segment per (image, temporal group): at least 4 patches each
    vpos = a.take<int32_t>(2 * P, DType::I32);
  }
};

bool DevModel::stage_owns(const ParamTable& t, const DevStage& s, int u) {
  const UnitInfo& U = t.units()[size_t(u)];
  const int p = U.params.front(), L = t.config().text.layers, l1 = s.l1 < 0 ? L : s.l1;
  for (int l = 0; l < L; ++l)  // a decoder layer's unit, or its experts'
    if (p >= t.layer(l) && p < t.layer(l) + tlay::count) return l >= s.l0 && l < l1;
  const auto holds = [&](int id) { return std::find(U.params.begin(), U.params.end(), id) != U.params.end(); };
  if (holds(t.final_norm()) || holds(t.lm_head())) return s.last || (s.first && t.lm_head() == t.embed_tokens() &&
                                                                     holds(t.embed_tokens()));
  return s.first;  // the embeddings, the vision tower and the mergers
}

bool DevModel::quant_param(const ParamTable& t, int id) {
  if (t.lm_head() == id) return t.lm_head() != t.embed_tokens();
  for (int l = 0; l < t.config().text.layers; ++l) {
    const int k = id - t.layer(l);
    if (k < 0 || k >= tlay::count) continue;
    if (k == tlay::q_proj || k == tlay::k_proj || k == tlay::v_proj || k == tlay::o_proj) return true;
    if (t.moe_layer(l)) return k == tlay::experts_gate_up || k == tlay::experts_down;
    return k == tlay::gate_proj || k == tlay::up_proj || k == tlay::down_proj;
  }
  return false;
}

int64_t DevModel::quant_rows(const ParamInfo& p) { return p.held / p.shape.back(); }

int64_t DevModel::weight_bytes(const ParamTable& t, DType dt, const DevStage& s, QFormat quant) {
  int64_t n = 0;
  for (size_t u = 0; u < t.units().size(); ++u)
    if (stage_owns(t, s, int(u)))
      for (int id : t.units()[u].params) {
        const ParamInfo& p = t.param(id);
        n += quant != QFormat::None && quant_param(t, id) ? p.held + quant_rows(p) * 4
                                                          : p.held * int64_t(dtype_size(dt));
      }
  return n;
}

DevModel::DevModel(const ModelConfig& cfg, const dev::Exec& ex, DType dt, bool grads, DevStage stage, QFormat quant,
                   DevHold hold, ExpertSplit ep)
    : cfg_(cfg), table_(cfg, ep), ex_(ex), dt_(dt), stage_(stage), hold_(hold), qf_(quant),
      impl_(std::make_unique<Impl>()) {
  const bool q8 = quant != QFormat::None;
  impl_->lora.table = &table_;
  impl_->lora.scale = float(cfg.lora.scale());
  impl_->lora.dropout = cfg.lora.dropout;
  Q3VL_CHECK((stage.whole() && !q8) || !grads, "DevModel: pipeline stages and 8-bit weights are for inference");
  Q3VL_CHECK(hold.group >= 1 && (hold.full || grads), "DevModel: a ZeRO hold is for training");
  if (ex.device == Device::CPU && dt != DType::F32)
    fail_all(std::string("model.dtype = ") + dtype_name(dt) + " needs model.backend = \"cuda\" (the CPU computes fp32)");
  // The parameters of the units the stage holds, packed in table order (the whole model in dt: the table's own
  // offsets, each unit padded to the hold's group); 8-bit weights in q8_, their scales in s8_.
  par_off_.assign(table_.params().size(), -1), scl_off_.assign(table_.params().size(), -1);
  ubase_.assign(table_.units().size(), -1);
  for (size_t u = 0; u < table_.units().size(); ++u)
    if (stage_owns(table_, stage_, int(u))) {
      ubase_[u] = held_;
      for (int id : table_.units()[u].params) {
        const ParamInfo& p = table_.param(id);
        if (q8 && quant_param(table_, id)) par_off_[id] = held8_, held8_ += p.held, scl_off_[id] = rows8_, rows8_ += quant_rows(p);
        else par_off_[id] = held_, held_ += p.held;  // expert parallelism: this rank's experts
      }
      if (!q8) held_ = ubase_[u] + padded(table_.units()[u].numel, hold.group);
    }
  if (!hold.full) held_ = 0;  // ZeRO-3: units are bound while in use
  params_ = held_ ? dev::alloc(ex_, size_t(held_) * dtype_size(dt_)) : nullptr;
  if (held8_) {
    q8_ = static_cast<uint8_t*>(dev::alloc(ex_, size_t(held8_)));
    s8_ = static_cast<float*>(dev::alloc(ex_, size_t(rows8_) * 4));
  }
  if (grads && hold.full) grads_ = static_cast<float*>(dev::alloc(ex_, size_t(held_) * 4));
  for (size_t id = 0; id < table_.params().size(); ++id) {
    const int64_t mine = par_off_[id];
    const bool i8 = scl_off_[id] >= 0;
    pp_.push_back(mine < 0 || i8 || !params_ ? nullptr : at(params_, mine, dt_));
    q8p_.push_back(i8 ? q8_ + mine : nullptr);
    s8p_.push_back(i8 ? s8_ + scl_off_[id] : nullptr);
    gp_.push_back(grads_ ? grads_ + mine : nullptr);
    gsize_.push_back(table_.param(int(id)).held);
  }
  fresh_.assign(gp_.size(), 0);
  if (grads_) dev::fill(ex_, grads_, DType::F32, held_, 0.f);  // the units' padding too, which no op writes
}

DevParams DevModel::dparams() const {
  // Adapters run in the training arena's passes (train, eval); serving folds them into the weights first.
  const DevLora* lora = cfg_.lora.on() && impl_->block ? &impl_->lora : nullptr;
  DevParams P{pp_.data(), gp_.data(), q8_ ? q8p_.data() : nullptr, q8_ ? s8p_.data() : nullptr,
              q8_ ? qf_ : QFormat::None, lora, fresh_.data(), gsize_.data()};
  if (sq_sum_) P.sq_sum = sq_sum_, P.sq_bad = sq_bad_, P.sq_at = sq_at_.data();
  return P;
}
void DevModel::take_grad_squares(double* sum, int32_t* bad) {
  Q3VL_CHECK(!sum == !bad, "DevModel::take_grad_squares: both slot arrays, or neither");
  sq_sum_ = sum, sq_bad_ = bad;
  sq_at_.assign(gp_.size(), nullptr);
}
DevLora& DevModel::lora() { return impl_->lora; }

void DevModel::bind_unit(int u, const void* params, float* grads, bool fresh) {
  for (int id : table_.units()[size_t(u)].params) {
    settle(size_t(id));  // what the gradient held last is complete before its buffer changes hands
    const int64_t off = table_.param(id).offset;
    pp_[size_t(id)] = params ? at(params, off, dt_) : nullptr;
    gp_[size_t(id)] = grads && !frozen(id) ? grads + off : nullptr;
    fresh_[size_t(id)] = fresh && gp_[size_t(id)];
  }
}
void DevModel::set_frozen(const std::vector<bool>& trainable) {
  Q3VL_CHECK(trainable.size() == table_.params().size(), "DevModel::set_frozen: one flag per parameter");
  trainable_ = trainable;
  for (size_t id = 0; id < gp_.size(); ++id)
    if (frozen(int(id))) gp_[id] = nullptr, fresh_[id] = 0;
}

void DevModel::enter(int id, bool bwd) {
  debug_stop_point(bwd ? "backward" : "forward");  // test hook, off unless runtime.debug_stop_rank is set
  if (hooks_) bwd ? hooks_->before_backward(table_.param(id).unit) : hooks_->before_forward(table_.param(id).unit);
}
void DevModel::leave(int id, bool bwd) {
  if (hooks_) bwd ? hooks_->after_backward(table_.param(id).unit) : hooks_->after_forward(table_.param(id).unit);
}
void DevModel::enter_layer(int l, bool bwd) {
  enter(table_.layer(l), bwd);
  if (table_.experts(l) >= 0) enter(table_.experts(l), bwd);
}
void DevModel::leave_layer(int l, bool bwd) {
  if (table_.experts(l) >= 0) leave(table_.experts(l), bwd);
  leave(table_.layer(l), bwd);
}
// The final norm's unit, and around it the LM head's when that is another (tied: the embeddings').
void DevModel::enter_head(bool bwd) {
  enter(table_.final_norm(), bwd);
  if (table_.param(table_.lm_head()).unit != table_.param(table_.final_norm()).unit) enter(table_.lm_head(), bwd);
}
void DevModel::leave_head(bool bwd) {
  if (table_.param(table_.lm_head()).unit != table_.param(table_.final_norm()).unit) leave(table_.lm_head(), bwd);
  leave(table_.final_norm(), bwd);
}

void DevModel::set_recompute(bool on) {
  Q3VL_CHECK(!impl_->block, "DevModel::set_recompute comes before reserve()");
  recompute_ = impl_->recompute = on;
}

void DevModel::set_experts(ExpertExchange* ex) {
  Q3VL_CHECK(!impl_->block, "DevModel::set_experts comes before reserve()");
  Q3VL_CHECK((ex ? ex->size() : 1) == table_.ep().size && (!ex || ex->rank() == table_.ep().rank),
             "DevModel::set_experts: the exchange's group is not the table's expert split");
  ep_ = ex && ex->size() > 1 ? ex : nullptr;
}

size_t DevModel::size_arena(Impl& i, const ModelConfig& cfg, DType dt, const DevBudget& b, bool recompute) {
  i.b = b;
  i.b.segments = std::max<int64_t>(b.segments, 1);
  i.recompute = recompute;
  Arena count;
  i.carve(count, cfg, dt);
  return count.used;
}

int64_t DevModel::activation_bytes(const ModelConfig& cfg, DType dt, const DevBudget& b, bool recompute) {
  Impl i;
  return int64_t(size_arena(i, cfg, dt, b, recompute));
}

void DevModel::reserve(const DevBudget& b) {
  Q3VL_CHECK(!impl_->block, "DevModel::reserve is called once");
  Q3VL_CHECK(b.ep == (ep_ ? ep_->size() : 1), "DevModel::reserve: the budget's ep is not the expert exchange's size");
  impl_->bytes = size_arena(*impl_, cfg_, dt_, b, impl_->recompute);
  impl_->block = dev::alloc(ex_, impl_->bytes);
  Arena a{static_cast<char*>(impl_->block), impl_->bytes};
  impl_->carve(a, cfg_, dt_);
  for (auto& c : impl_->dctx) c.ex = ep_;
  for (auto& c : impl_->dwork) c.ex = ep_;
}


void DevModel::set_params(const float* host_all) {
  const int64_t n = table_.total();
  Q3VL_CHECK(hold_.group == 1 && hold_.full, "DevModel::set_params: the whole table needs an unpadded model");
  if (dt_ != DType::F32 && grads_) {  // through the gradient buffer as fp32 staging (it is zeroed again after)
    dev::to_device(ex_, grads_, host_all, size_t(n) * 4);
    dev::convert(ex_, params_, dt_, grads_, DType::F32, n);
    return zero_grads();
  }
  set_params(0, host_all, n);
}
void DevModel::set_params(int64_t offset, const float* host, int64_t n) {
  Q3VL_CHECK(offset >= 0 && offset + n <= table_.total(), "DevModel::set_params: a range outside the table");
  Q3VL_CHECK(table_.ep().size == 1 || !grads_, "DevModel::set_params: an expert-parallel model is filled through ZeRO");
  // The held parameters' parts of the range, each to its packed place, through a staging buffer of at most 256 MiB;
  // an 8-bit weight, which must arrive whole, is quantized here first.
  constexpr int64_t kChunk = int64_t(64) << 20;
  float* stage = nullptr;
  if (dt_ != DType::F32) stage = static_cast<float*>(dev::alloc(ex_, size_t(std::min<int64_t>(n, kChunk)) * 4));
  std::vector<uint8_t> q;
  std::vector<float> sc;
  for (size_t id = 0; id < table_.params().size(); ++id) {
    const ParamInfo& p = table_.param(int(id));
    const int64_t start = table_.units()[p.unit].offset + p.offset;
    const int64_t a = std::max(offset, start), b = std::min(offset + n, start + p.held);
    if (par_off_[id] < 0 || a >= b) continue;
    if (scl_off_[id] >= 0) {
      Q3VL_CHECK(a == start && b == start + p.held,
                 std::string("DevModel::set_params: ") + qformat_name(qf_) + " weight " + p.name + " must arrive whole");
      const int64_t rows = quant_rows(p), cols = p.held / rows;
      q.resize(size_t(p.held)), sc.resize(size_t(rows));
      // On every core: a 30B-A3B's experts are 29 G weights to quantize at start-up.
      const int64_t per = std::max<int64_t>(1, (int64_t(1) << 20) / cols);  // about 1 Mi weights per item
      parallel_for((rows + per - 1) / per, [&](int64_t i) {
        const int64_t r0 = i * per, nr = std::min(per, rows - r0);
        try {
          ops::quantize_rows(qf_, host + (a - offset) + r0 * cols, nr, cols, q.data() + r0 * cols, sc.data() + r0);
        } catch (const Error& e) {
          fail(p.name + ", rows from " + std::to_string(r0) + ": " + e.what());
        }
      });
      dev::to_device(ex_, q8_ + par_off_[id], q.data(), q.size());
      dev::to_device(ex_, s8_ + scl_off_[id], sc.data(), sc.size() * 4);
      dev::synchronize(ex_);  // q and sc are reused
      continue;
    }
    const int64_t to = par_off_[id] + (a - start);
    if (!stage) {
      dev::to_device(ex_, at(params_, to, dt_), host + (a - offset), size_t(b - a) * 4);
      continue;
    }
    for (int64_t i = a; i < b; i += kChunk) {
      const int64_t m = std::min(kChunk, b - i);
      dev::to_device(ex_, stage, host + (i - offset), size_t(m) * 4);
      dev::convert(ex_, at(params_, to + (i - a), dt_), dt_, stage, DType::F32, m);
      dev::synchronize(ex_);  // the staging buffer is reused
    }
  }
  dev::synchronize(ex_);
  if (stage) dev::release(ex_, stage);
}
void DevModel::zero_grads() {
  for (size_t id = 0; id < gp_.size(); ++id) fresh_[id] = gp_[id] && grads_;
}
void DevModel::settle(size_t id) {
  if (fresh_[id] && gp_[id]) dev::fill(ex_, gp_[id], DType::F32, gsize_[id], 0.f), fresh_[id] = 0;
}
void DevModel::settle_grads() {
  for (size_t id = 0; id < gp_.size(); ++id) settle(id);
}
void DevModel::grads_to_host(float* host_all) {
  Q3VL_CHECK(hold_.group == 1 && hold_.full, "DevModel::grads_to_host needs an unpadded model");
  settle_grads();
  dev::to_host(ex_, host_all, grads_, size_t(table_.total()) * 4);
}

namespace {
// Images as they are; with videos, every visual span in input order (model/positions.hpp's visual_input).
template <class B>
double forward_visual(const ModelConfig& cfg, const B& b, TokenStream&& s,
                      const std::function<double(TokenStream&&, const std::vector<float>&,
                                                 const std::vector<int64_t>&)>& run) {
  if (b.video_grid_thw.empty() && b.pixel_values_videos.empty()) return run(std::move(s), b.pixel_values, b.image_grid_thw);
  const VisualInput v = visual_input(cfg, s.ids, b.pixel_values, b.image_grid_thw, b.pixel_values_videos,
                                     b.video_grid_thw);
  return run(std::move(s), v.pixels, v.grid);
}
}  // namespace

double DevModel::forward(const Batch& b, bool keep, std::vector<float>* logits_out, double* aux_out, bool aux_loss) {
  return forward_visual(cfg_, b, token_stream(b), [&](TokenStream&& s, const auto& px, const auto& g) {
    return run(std::move(s), px, g, keep, logits_out, aux_out, aux_loss);
  });
}
double DevModel::forward(const PackedBatch& b, bool keep, std::vector<float>* logits_out, double* aux_out,
                         bool aux_loss) {
  return forward_visual(cfg_, b, token_stream(b), [&](TokenStream&& s, const auto& px, const auto& g) {
    return run(std::move(s), px, g, keep, logits_out, aux_out, aux_loss);
  });
}

namespace {
void up32(const dev::Exec& ex, int32_t* dst, const std::vector<int64_t>& v) {
  const std::vector<int32_t> w(v.begin(), v.end());
  dev::to_device(ex, dst, w.data(), w.size() * 4);
}
void up32(const dev::Exec& ex, int32_t* dst, const std::vector<int32_t>& v) {
  dev::to_device(ex, dst, v.data(), v.size() * 4);
}
// fp32 host values into a dt device array (rounded on the host: the values are on the host anyway), through
// `stage` (null: a buffer of its own; a step's reused one spares the page faults of a fresh one each time).
void up_dt(const dev::Exec& ex, void* dst, const float* src, size_t n, DType dt,
           std::vector<uint16_t>* stage = nullptr) {
  if (dt == DType::F32) return dev::to_device(ex, dst, src, n * 4);
  std::vector<uint16_t> own;
  std::vector<uint16_t>& h = stage ? *stage : own;
  if (h.size() < n) h.resize(n);
  if (dt == DType::BF16) f32_to_bf16(src, int64_t(n), h.data());
  else std::transform(src, src + n, h.begin(), [](float v) { return f32_to_f16(v); });
  dev::to_device(ex, dst, h.data(), n * 2);
}
// A dt device array to fp32 host values.
void down_f32(const dev::Exec& ex, float* dst, const void* src, size_t n, DType dt) {
  if (dt == DType::F32) return dev::to_host(ex, dst, src, n * 4);
  std::vector<uint16_t> h(n);
  dev::to_host(ex, h.data(), src, n * 2);
  for (size_t i = 0; i < n; ++i) dst[i] = dt == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
}
void budget_check(int64_t need, int64_t have, const char* what) {
  if (need > have)
    fail("the batch needs " + std::to_string(need) + " " + what + ", the model was sized for " + std::to_string(have) +
         " (train.seq_len / micro-batch / image limits)");
}

// Device buffers of a vision pass (carved by the training or the inference arena).
struct VisionBufs {
  void *pixels, *vx, *img;
  std::vector<void*> ds;
  float *vcos, *vsin;
  int32_t *vcu, *vpos;  // vpos: the patches' rows, then their columns (the rotary table's positions)
};
// The vision tower, the merger and the DeepStack mergers over the Np patches in b.pixels (uploaded by the caller):
// b.img [Np/4, H] and b.ds.
// ctx(i) is block i's context; keep_in (may be null) receives each block's input (recomputation). Returns the
// attention segments (per image and temporal group), which the backward reuses.
DevSegments vision_tower(const dev::Exec& ex, const ModelConfig& cfg, const ParamTable& t, const DevParams& P,
                  const std::vector<int64_t>& grid, int64_t Np, const VisionBufs& b,
                  const std::function<DevVisionBlockCtx&(int)>& ctx, void* const* keep_in, DevVisionScratch& scr,
                  DevMergerCtx& m, std::vector<DevMergerCtx>& dsm, DType dt,
                  const std::function<void(int id, bool in)>& use = nullptr) {
  const VisionConfig& vc = cfg.vision;
  auto hook = [&](int id, bool in) {
    if (use) use(id, in);
  };
  const std::vector<int64_t> vcu = vision_cu_seqlens(grid);
  const int64_t vseg = int64_t(vcu.size()) - 1;
  int64_t vmax = 0;
  for (int64_t k = 0; k < vseg; ++k) vmax = std::max(vmax, vcu[k + 1] - vcu[k]);
  up32(ex, b.vcu, vcu);
  std::vector<int64_t> row, col;
  vision_patch_coords(grid, vc.merge, row, col);
  row.insert(row.end(), col.begin(), col.end());
  up32(ex, b.vpos, row);
  const int64_t W = vc.head_dim() / 2;
  std::vector<int> axis(W);
  std::vector<float> freq(W);
  ops::vision_rope_cols(vc.head_dim(), axis.data(), freq.data());
  dev::rope_table(ex, b.vpos, Np, W, axis.data(), freq.data(), b.vcos, b.vsin);
  const DevSegments vs{b.vcu, vseg, vmax};
  hook(t.vision_embed(), true);
  dev_vision_embed_fwd(ex, vc, P, t.vision_embed(), b.pixels, grid, Np, b.vx, dt);
  hook(t.vision_embed(), false);
  for (int i = 0; i < vc.depth; ++i) {
    if (keep_in) dev::copy(ex, keep_in[i], b.vx, size_t(Np * vc.hidden) * dtype_size(dt));
    hook(t.vision_block(i), true);
    dev_vision_block_fwd(ex, vc, P, t.vision_block(i), b.vx, Np, vs, b.vcos, b.vsin, ctx(i), scr, dt);
    hook(t.vision_block(i), false);
    for (size_t j = 0; j < vc.deepstack_indexes.size(); ++j)
      if (vc.deepstack_indexes[j] == i) {
        hook(t.deepstack_merger(j), true);
        dev_merger_fwd(ex, vc, P, t.deepstack_merger(j), true, b.vx, Np, b.ds[j], dsm[j], dt);
        hook(t.deepstack_merger(j), false);
      }
  }
  hook(t.merger(), true);
  dev_merger_fwd(ex, vc, P, t.merger(), false, b.vx, Np, b.img, m, dt);
  hook(t.merger(), false);
  return vs;
}
}  // namespace

double DevModel::run(TokenStream&& s, const std::vector<float>& pixels, const std::vector<int64_t>& grid, bool keep,
                     std::vector<float>* logits_out, double* aux_out, bool aux_loss) {
  Impl& I = *impl_;
  Q3VL_CHECK(I.block, "DevModel::reserve must size the model before a forward");
  const VisionConfig& vc = cfg_.vision;
  const TextConfig& tc = cfg_.text;
  const DevParams P = dparams();
  const int64_t N = int64_t(s.ids.size()), H = tc.hidden, V = tc.vocab, E = tc.num_experts, K = tc.experts_per_tok;
  const size_t nds = vc.deepstack_indexes.size();
  kept_ = false;
  I.st = std::move(s);
  I.grid = grid;
  I.N = N;
  I.Np = image_patches(vc, pixels.size(), grid);
  budget_check(N, I.b.tokens, "tokens");
  budget_check(I.Np, I.b.patches, "image patches");
  budget_check(int64_t(I.st.cu.size()) - 1, I.b.segments, "samples");

  // Metadata: ids, segments, M-RoPE tables, image-token rows, supervised rows.
  up32(ex_, I.ids, I.st.ids);
  up32(ex_, I.cu, I.st.cu);
  I.nseg = int64_t(I.st.cu.size()) - 1;
  I.max_len = 0;
  for (int64_t k = 0; k < I.nseg; ++k) I.max_len = std::max(I.max_len, I.st.cu[k + 1] - I.st.cu[k]);
  {  // the M-RoPE tables from the positions, on the device (the host's sines took ~15 ms of a 2B step's)
    up32(ex_, I.pos, mrope_positions(cfg_, I.st.ids.data(), I.st.cu, grid));
    const int64_t W = tc.head_dim / 2;
    std::vector<int> axis(W);
    std::vector<float> freq(W);
    ops::mrope_cols(tc.head_dim, tc.rope_theta, tc.mrope_section.data(), axis.data(), freq.data());
    dev::rope_table(ex_, I.pos, N, W, axis.data(), freq.data(), I.tcos, I.tsin);
  }
  std::vector<int64_t> vis, sup, sup_t;
  for (int64_t i = 0; i < N; ++i) {
    if (cfg_.visual_token(I.st.ids[i])) vis.push_back(i);
    if (I.st.targets[i] != -100) sup.push_back(i), sup_t.push_back(I.st.targets[i]);
  }
  if (int64_t(vis.size()) * 4 != I.Np)
    fail("vision features and placeholder tokens do not match: " + std::to_string(vis.size()) + " tokens with id " +
         std::to_string(cfg_.image_token_id) + " or " + std::to_string(cfg_.video_token_id) + ", " +
         std::to_string(I.Np / 4) + " merged vision features");
  I.nvis = int64_t(vis.size());
  I.nsup = int64_t(sup.size());
  count_ = I.nsup;
  up32(ex_, I.vis, vis);
  up32(ex_, I.sup, sup);
  up32(ex_, I.sup_t, sup_t);
  const double zeros[2] = {0, 0};
  dev::to_device(ex_, I.sums, zeros, sizeof zeros);

  // Vision tower, mergers and DeepStack features.
  if (I.Np > 0) {
    up_dt(ex_, I.pixels, pixels.data(), pixels.size(), dt_, &I.stage);
    const VisionBufs vb{I.pixels, I.vx, I.img, I.ds, I.vcos, I.vsin, I.vcu, I.vpos};
    const DevSegments vs = vision_tower(ex_, cfg_, table_, P, grid, I.Np, vb,
                 [&](int i) -> DevVisionBlockCtx& { return recompute_ ? I.vwork : I.vctx[i]; },
                 recompute_ ? I.vxin.data() : nullptr, I.vscr, I.mctx, I.dsctx, dt_,
                 [&](int id, bool in) { in ? enter(id, false) : leave(id, false); });
    I.vseg = vs.nseg, I.vmax = vs.max_len;
  }

  // Token embeddings with the image features over the image tokens.
  enter(table_.embed_tokens(), false);
  dev::embedding_fwd(ex_, I.ids, pp_[table_.embed_tokens()], I.x, N, H, V, dt_);
  leave(table_.embed_tokens(), false);
  if (I.nvis) dev::scatter_rows(ex_, I.img, I.vis, I.x, I.nvis, H, false, dt_);

  // Decoder with DeepStack injection after the first layers.
  const DevSegments seg{I.cu, I.nseg, I.max_len};
  int slot = 0;
  for (int l = 0; l < tc.layers; ++l) {
    const bool moe = table_.moe_layer(l);
    float* pr = moe ? I.probs + slot * N * E : nullptr;
    int32_t* ix = moe ? I.idx + slot * N * K : nullptr;
    slot += moe;
    if (recompute_) dev::copy(ex_, I.dxin[l], I.x, size_t(N * H) * dtype_size(dt_));
    enter_layer(l, false);
    DevDecoderCtx& c = recompute_ ? I.dwork[moe] : I.dctx[l];
    dev_decoder_fwd(ex_, cfg_, P, table_.layer(l), moe, I.x, N, seg, I.tcos, I.tsin, pr, ix, c, I.dscr, dt_);
    if (moe && ep_) ep_->note_received(c.ro);  // the experts' load (a recomputed forward is not counted again)
    leave_layer(l, false);
    if (size_t(l) < nds && I.nvis) dev::scatter_rows(ex_, I.ds[l], I.vis, I.x, I.nvis, H, true, dt_);
  }

  const int64_t nmoe = slot;
  if (nmoe > 0) dev::aux_loss_fwd(ex_, I.probs, I.idx, I.aux_f, I.sums + 1, nmoe * N, E, K);
  aux_on_ = aux_loss && nmoe > 0;
  kept_ = keep;
  head_deferred_ = keep && !logits_out && loss_in_bwd_;
  if (head_deferred_) return std::numeric_limits<double>::quiet_NaN();  // backward() computes it; loss() reads it

  // Final norm (I.x is its input, kept), LM head and loss.
  enter_head(false);
  dev::rmsnorm_fwd(ex_, I.x, pp_[table_.final_norm()], I.hf, I.rf, N, H, tc.rms_eps, dt_);
  const void* W = pp_[table_.lm_head()];
  if (logits_out) {  // every row's logits (eval): chunks of rows in order
    logits_out->assign(I.st.out_rows * V, 0.f);
    std::vector<int64_t> tg(I.st.targets);
    up32(ex_, I.head_t, tg);
    std::vector<float> chunk;
    for (int64_t r0 = 0; r0 < N; r0 += I.head_rows) {
      const int64_t n = std::min(I.head_rows, N - r0);
      dev::linear_fwd(ex_, at(I.hf, r0 * H, dt_), W, nullptr, I.lg, n, H, V, dt_);
      dev_lora_fwd(ex_, P, table_.lm_head(), at(I.hf, r0 * H, dt_), n, I.lg, V, dt_, 0, -1, r0);
      dev::cross_entropy(ex_, I.lg, I.head_t + r0, I.rowloss, nullptr, I.sums, n, V, 0.f, true, dt_);
      chunk.resize(n * V);
      if (dt_ == DType::F32) {
        dev::to_host(ex_, chunk.data(), I.lg, chunk.size() * 4);
      } else {
        std::vector<uint16_t> h(n * V);
        dev::to_host(ex_, h.data(), I.lg, h.size() * 2);
        for (int64_t i = 0; i < n * V; ++i) chunk[i] = dt_ == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
      }
      for (int64_t i = 0; i < n; ++i)
        std::copy(&chunk[i * V], &chunk[(i + 1) * V], &(*logits_out)[I.st.orig[r0 + i] * V]);
    }
  } else {  // training: only supervised rows go through the head
    for (int64_t r0 = 0; r0 < I.nsup; r0 += I.head_rows) {
      const int64_t n = std::min(I.head_rows, I.nsup - r0);
      dev::gather_rows(ex_, I.hf, I.sup + r0, 1, I.hb, n, H, dt_);
      dev::linear_fwd(ex_, I.hb, W, nullptr, I.lg, n, H, V, dt_);
      dev_lora_fwd(ex_, P, table_.lm_head(), I.hb, n, I.lg, V, dt_, 0, -1, r0);
      dev::cross_entropy(ex_, I.lg, I.sup_t + r0, I.rowloss, nullptr, I.sums, n, V, 0.f, true, dt_);
    }
  }
  leave_head(false);
  return loss(aux_out);
}

double DevModel::loss(double* aux_out) {
  if (head_deferred_ && kept_)
    fail("DevModel::loss called between a forward whose LM head and loss run in the backward (set_loss_in_backward) "
         "and that backward");
  double sums[2];
  dev::to_host(ex_, sums, impl_->sums, sizeof sums);
  double l = count_ ? sums[0] / double(count_) : 0.0;
  if (aux_out) *aux_out = sums[1];
  if (aux_on_) l += cfg_.text.router_aux_loss_coef * sums[1];
  return l;
}

void DevModel::backward(float loss_scale) {
  if (!kept_) fail("DevModel::backward called without a forward(keep_for_backward=true) before it");
  kept_ = false;
  Impl& I = *impl_;
  const VisionConfig& vc = cfg_.vision;
  const TextConfig& tc = cfg_.text;
  const DevParams P = dparams();
  const int64_t N = I.N, H = tc.hidden, V = tc.vocab, E = tc.num_experts, K = tc.experts_per_tok;
  const size_t nds = vc.deepstack_indexes.size();

  // LM head: each chunk's logits (again, unless the forward left the head to this pass: then also the final norm
  // and the loss), d(CE)/d(logits), then the head's input and weight gradients.
  dev::fill(ex_, I.dh, dt_, N * H, 0.f);
  enter_head(true);
  if (head_deferred_) dev::rmsnorm_fwd(ex_, I.x, pp_[table_.final_norm()], I.hf, I.rf, N, H, tc.rms_eps, dt_);
  const void* W = pp_[table_.lm_head()];
  for (int64_t r0 = 0; r0 < I.nsup; r0 += I.head_rows) {
    const int64_t n = std::min(I.head_rows, I.nsup - r0);
    dev::gather_rows(ex_, I.hf, I.sup + r0, 1, I.hb, n, H, dt_);
    dev::linear_fwd(ex_, I.hb, W, nullptr, I.lg, n, H, V, dt_);
    dev_lora_fwd(ex_, P, table_.lm_head(), I.hb, n, I.lg, V, dt_, 0, -1, r0);
    dev::cross_entropy(ex_, I.lg, I.sup_t + r0, I.rowloss, I.dlg, head_deferred_ ? I.sums : nullptr, n, V,
                       float(loss_scale / double(I.nsup)), false, dt_);
    dev::linear_bwd(ex_, I.dlg, I.hb, W, I.dhb, gp_[table_.lm_head()], nullptr, n, H, V, false,
                    dev_grad_adds(ex_, P, {table_.lm_head()}), dt_);  // the first chunk writes
    dev_lora_bwd(ex_, P, table_.lm_head(), I.dlg, V, I.hb, n, I.dhb, dt_, 0, -1, r0);
    dev::scatter_rows(ex_, I.dhb, I.sup + r0, I.dh, n, H, false, dt_);
  }
  dev_grad_zeroed(ex_, P, table_.final_norm());
  dev::rmsnorm_bwd(ex_, I.dh, I.x, pp_[table_.final_norm()], I.rf, I.dx, gp_[table_.final_norm()], N, H, false, dt_);
  leave_head(true);

  int64_t nmoe = 0;
  for (int l = 0; l < tc.layers; ++l) nmoe += table_.moe_layer(l);
  if (aux_on_) {
    dev::aux_loss_bwd(ex_, I.probs, I.aux_f, float(tc.router_aux_loss_coef * loss_scale), I.aux_dl, nmoe * N, E,
                      false, DType::F32);
  }
  const DevSegments seg{I.cu, I.nseg, I.max_len};
  int64_t slot = nmoe;
  for (int l = tc.layers - 1; l >= 0; --l) {
    if (size_t(l) < nds && I.nvis) dev::gather_rows(ex_, I.dx, I.vis, 1, I.dds[l], I.nvis, H, dt_);
    const bool moe = table_.moe_layer(l);
    slot -= moe;
    const float* pr = moe ? I.probs + slot * N * E : nullptr;
    const int32_t* ix = moe ? I.idx + slot * N * K : nullptr;
    const void* adl = moe && aux_on_ ? at(I.aux_dl, slot * N * E, DType::F32) : nullptr;
    DevDecoderCtx* c = recompute_ ? &I.dwork[moe] : &I.dctx[l];
    enter_layer(l, true);
    if (recompute_)  // rerun into the shared context; probs/idx get the values they already hold
      dev_decoder_fwd(ex_, cfg_, P, table_.layer(l), moe, I.dxin[l], N, seg, I.tcos, I.tsin, const_cast<float*>(pr),
                      const_cast<int32_t*>(ix), *c, I.dscr, dt_);
    dev_decoder_bwd(ex_, cfg_, P, table_.layer(l), moe, I.dx, N, seg, I.tcos, I.tsin, pr, ix, adl, *c, I.dscr, dt_);
    leave_layer(l, true);
  }
  // Image positions were overwritten by the image features: their rows go to the merger, not the embedding.
  if (I.nvis) {
    dev::gather_rows(ex_, I.dx, I.vis, 1, I.dimg, I.nvis, H, dt_);
    dev::fill(ex_, I.dh, dt_, I.nvis * H, 0.f);
    dev::scatter_rows(ex_, I.dh, I.vis, I.dx, I.nvis, H, false, dt_);
  }
  enter(table_.embed_tokens(), true);
  dev_grad_zeroed(ex_, P, table_.embed_tokens());  // a scatter: it adds
  dev::embedding_bwd(ex_, I.ids, I.dx, gp_[table_.embed_tokens()], N, H, dt_);
  leave(table_.embed_tokens(), true);

  if (I.Np > 0) {
    const DevSegments vs{I.vcu, I.vseg, I.vmax};
    enter(table_.merger(), true);
    dev_merger_bwd(ex_, vc, P, table_.merger(), false, I.dimg, I.Np, I.dv, false, I.mctx, I.mscr, dt_);
    leave(table_.merger(), true);
    for (int i = vc.depth - 1; i >= 0; --i) {
      for (size_t j = 0; j < nds; ++j)
        if (vc.deepstack_indexes[j] == i && j < size_t(tc.layers)) {
          enter(table_.deepstack_merger(j), true);
          dev_merger_bwd(ex_, vc, P, table_.deepstack_merger(j), true, I.dds[j], I.Np, I.dv, true, I.dsctx[j], I.mscr,
                         dt_);
          leave(table_.deepstack_merger(j), true);
        }
      DevVisionBlockCtx* c = recompute_ ? &I.vwork : &I.vctx[i];
      enter(table_.vision_block(i), true);
      if (recompute_)
        dev_vision_block_fwd(ex_, vc, P, table_.vision_block(i), I.vxin[i], I.Np, vs, I.vcos, I.vsin, *c, I.vscr, dt_);
      dev_vision_block_bwd(ex_, vc, P, table_.vision_block(i), I.dv, I.Np, vs, I.vcos, I.vsin, *c, I.vscr, dt_);
      leave(table_.vision_block(i), true);
    }
    enter(table_.vision_embed(), true);
    dev_vision_embed_bwd(ex_, vc, P, table_.vision_embed(), I.pixels, I.grid, I.Np, I.dv, dt_);
    leave(table_.vision_embed(), true);
  }
  settle_grads();  // the parameters this pass left alone (a batch without images: the vision tower's)
}

void DevModel::idle_pass(bool backward) {
  if (!ep_) return;
  Impl& I = *impl_;
  Q3VL_CHECK(I.block, "DevModel::reserve must size the model before a pass");
  const DevParams P = dparams();
  const int L = cfg_.text.layers;
  for (int i = 0; i < L; ++i) {
    const int l = backward ? L - 1 - i : i;
    if (table_.experts(l) < 0) continue;
    DevDecoderCtx& c = recompute_ ? I.dwork[1] : I.dctx[l];
    enter(table_.experts(l), backward);
    if (!backward || recompute_) dev_moe_experts_fwd(ex_, cfg_.text, P, table_.layer(l), 0, c, I.dscr, dt_);
    if (!backward) ep_->note_received(c.ro);
    if (backward) dev_moe_experts_bwd(ex_, cfg_.text, P, table_.layer(l), nullptr, 0, c, I.dscr, dt_);
    leave(table_.experts(l), backward);
  }
  if (backward) settle_grads();
}

// ---- Inference ---------------------------------------------------------------------------------------------------

struct DevModel::Infer {
  InferBudget b;
  DevStage st;
  void* block = nullptr;
  size_t bytes = 0;
  std::vector<void*> k, v;  // [layer] pools [kv_blocks * block, kv_heads * head_dim]
  DevDecoderCtx dwork[2];   // [0] dense, [1] MoE: one layer at a time, nothing kept
  DevDecoderScratch dscr;
  int32_t *ids, *cu, *ctx, *table, *slots, *vis, *last;
  float *tcos, *tsin, *rf, *lgf, *probs, *red;
  int32_t* idx;
  void *x, *img, *hb, *hf, *lg;
  std::vector<void*> ds;
  // Vision pass.
  DevVisionBlockCtx vwork;
  DevVisionScratch vscr;
  DevMergerCtx mctx;
  std::vector<DevMergerCtx> dsctx;
  VisionBufs vb{};
  // Tensor parallelism.
  Comm* tp = nullptr;
  std::vector<float> host_red;
  int64_t v0 = 0, v1 = 0;
  // Decode steps as graphs, by padded segment count (set_graphs); off after a capture the device refused.
  bool graphs = false, graphs_failed = false;
  std::map<std::array<int64_t, 4>, void*> graph;  // by (segments, argmax, limit, banned)
  int32_t *bidx, *banned;  // greedy steps: [S] ids, [kMaxBanned] ids never chosen
  float* bval;
  StepPhases* phases = nullptr;  // set_step_phases
  std::vector<uint16_t> stage;   // the host side of a step's uploads in bf16 / fp16

  void carve(Arena& a, const ModelConfig& cfg, DType dt) {
    const TextConfig& tc = cfg.text;
    const VisionConfig& vc = cfg.vision;
    const ParamTable t(cfg);
    const int64_t T = std::max<int64_t>(b.tokens, 1), S = std::max<int64_t>(b.segments, 1), H = tc.hidden;
    const int64_t V = tc.vocab, P = st.first ? b.patches : 0, Pm = P / 4, nds = int64_t(vc.deepstack_indexes.size());
    const int64_t row = int64_t(tc.kv_heads) * tc.head_dim, pool = b.kv_blocks * b.block * row;
    const int l1 = st.l1 < 0 ? tc.layers : st.l1;
    k.assign(tc.layers, nullptr), v.assign(tc.layers, nullptr);
    for (int l = st.l0; l < l1; ++l) k[l] = a.take(pool, dt), v[l] = a.take(pool, dt);
    bool kinds[2] = {false, false};
    for (int l = 0; l < tc.layers; ++l) kinds[t.moe_layer(l)] = true;
    for (int m = 0; m < 2; ++m)
      if (kinds[m]) dwork[m].carve(a, tc, m == 1, T, dt);
    dscr.carve(a, tc, kinds[1], T, dt);
    ids = a.take<int32_t>(T, DType::I32), cu = a.take<int32_t>(S + 1, DType::I32);
    ctx = a.take<int32_t>(S, DType::I32), table = a.take<int32_t>(S * std::max<int64_t>(b.seq_blocks, 1), DType::I32);
    slots = a.take<int32_t>(T, DType::I32), vis = a.take<int32_t>(T, DType::I32), last = a.take<int32_t>(S, DType::I32);
    tcos = a.take<float>(T * tc.head_dim / 2, DType::F32), tsin = a.take<float>(T * tc.head_dim / 2, DType::F32);
    x = a.take(T * H, dt), img = a.take(T * H, dt);
    ds.assign(nds, nullptr);
    for (auto& p : ds) p = a.take(T * H, dt);
    hb = a.take(S * H, dt), hf = a.take(S * H, dt), rf = a.take<float>(S, DType::F32);
    lg = a.take(S * V, dt), lgf = a.take<float>(S * V, DType::F32);
    probs = a.take<float>(kinds[1] ? T * tc.num_experts : 1, DType::F32);
    idx = a.take<int32_t>(kinds[1] ? T * tc.experts_per_tok : 1, DType::I32);
    red = a.take<float>(T * H, DType::F32);
    bidx = a.take<int32_t>(S, DType::I32), bval = a.take<float>(S, DType::F32);
    banned = a.take<int32_t>(kMaxBanned, DType::I32);
    vb = {};
    dsctx.assign(P ? nds : 0, {});
    if (!P) return;
    vwork.carve(a, vc, P, dt);
    vscr.carve(a, vc, P, dt);
    mctx.carve(a, vc, false, P, dt);
    for (auto& c : dsctx) c.carve(a, vc, true, P, dt);
    vb.pixels = a.take(P * vc.patch_dim(), dt), vb.vx = a.take(P * vc.hidden, dt), vb.img = a.take(Pm * H, dt);
    vb.ds.assign(nds, nullptr);
    for (auto& p : vb.ds) p = a.take(Pm * H, dt);
    vb.vcos = a.take<float>(P * vc.head_dim() / 2, DType::F32), vb.vsin = a.take<float>(P * vc.head_dim() / 2, DType::F32);
    vb.vcu = a.take<int32_t>(Pm + 1, DType::I32), vb.vpos = a.take<int32_t>(2 * P, DType::I32);
  }
};

DevModel::~DevModel() {
  dev::synchronize(ex_);
  if (impl_->block) dev::release(ex_, impl_->block);
  if (infer_)
    for (auto& [n, g] : infer_->graph) dev::graph_destroy(ex_, g);
  if (infer_ && infer_->block) dev::release(ex_, infer_->block);
  if (params_) dev::release(ex_, params_);
  if (q8_) dev::release(ex_, q8_), dev::release(ex_, s8_);
  if (grads_) dev::release(ex_, grads_);
}

DevMemory DevModel::memory() const {
  DevMemory m;
  m.weights = held_ * int64_t(dtype_size(dt_)) + held8_ + rows8_ * 4;
  m.grads = grads_ ? held_ * 4 : 0;
  m.activations = int64_t(impl_->bytes) + (infer_ ? int64_t(infer_->bytes) : 0);
  m.workspace = int64_t(ex_.ws_bytes);
  return m;
}

int64_t DevModel::kv_pool_bytes(const ModelConfig& cfg, DType dt, int64_t blocks, int64_t block, const DevStage& s) {
  const int64_t layers = (s.l1 < 0 ? cfg.text.layers : s.l1) - s.l0;
  return 2 * layers * blocks * block * cfg.text.kv_heads * cfg.text.head_dim * int64_t(dtype_size(dt));
}

int64_t DevModel::infer_bytes(const ModelConfig& cfg, DType dt, const InferBudget& b, const DevStage& s) {
  Infer i;
  i.b = b;
  i.st = s;
  Arena count;
  i.carve(count, cfg, dt);
  return int64_t(count.used);
}

void DevModel::reserve_infer(const InferBudget& b) {
  if (!infer_) infer_ = std::make_unique<Infer>();
  Infer& J = *infer_;
  Q3VL_CHECK(!J.block, "DevModel::reserve_infer is called once");
  J.b = b;
  J.st = stage_;
  J.bytes = size_t(infer_bytes(cfg_, dt_, b, stage_));
  J.block = dev::alloc(ex_, J.bytes);
  Arena a{static_cast<char*>(J.block), J.bytes};
  J.carve(a, cfg_, dt_);
  if (const ExpertSplit& e = table_.ep(); e.size > 1)  // serving with serve.ep: this rank's experts of the router's
    J.dwork[1].el = table_.experts_per_rank(), J.dwork[1].e0 = int64_t(e.rank) * J.dwork[1].el;
  dev::fill(ex_, J.block, DType::F32, int64_t(J.bytes / 4), 0.f);  // no stale values in a pool row, ever
}

void DevModel::set_tensor_parallel(Comm* comm, int64_t v0, int64_t v1) {
  if (!infer_) infer_ = std::make_unique<Infer>();
  Q3VL_CHECK(!comm || comm->kind() != "nccl" || ex_.device == Device::CUDA, "an NCCL group needs the model on a GPU");
  infer_->tp = comm, infer_->v0 = v0, infer_->v1 = v1;
}

void DevModel::set_graphs(bool on) {
  if (!infer_) infer_ = std::make_unique<Infer>();
  infer_->graphs = on;
}

void DevModel::set_step_phases(StepPhases* p) {
  if (!infer_) infer_ = std::make_unique<Infer>();
  infer_->phases = p;
}

int64_t DevModel::graphs_recorded() const { return infer_ ? int64_t(infer_->graph.size()) : 0; }

// 1, 4, 8, then multiples of 8: at most 12 graphs for 64 sequences, and a padded row costs a decode GEMM little
// (it reads the weights once for all rows); never above `most` (the step buffers' rows).
int64_t DevModel::decode_bucket(int64_t segments, int64_t most) {
  const int64_t b = segments <= 1 ? 1 : segments <= 4 ? 4 : (segments + 7) / 8 * 8;
  return std::max(segments, std::min(b, most));
}

void DevModel::vision_features(const std::vector<float>& pixels, const std::vector<int64_t>& grid,
                               std::vector<float>& img, std::vector<std::vector<float>>& ds) {
  vision_features({VisionJob{&pixels, &grid, &img, &ds}});
}

int64_t DevModel::vision_budget() const { return infer_ ? infer_->b.patches : 0; }

namespace {
// A dt device array of [sum rows, H] to fp32 host values: rows[k] of them into *dst[k], in order (one transfer).
void down_rows(const dev::Exec& ex, const void* src, int64_t H, DType dt, const std::vector<int64_t>& rows,
               const std::vector<std::vector<float>*>& dst) {
  int64_t n = 0;
  for (int64_t r : rows) n += r * H;
  std::vector<uint16_t> h(dt == DType::F32 ? 0 : size_t(n));
  if (dt != DType::F32) dev::to_host(ex, h.data(), src, h.size() * 2);
  int64_t off = 0;
  for (size_t k = 0; k < rows.size(); off += rows[k] * H, ++k) {
    std::vector<float>& d = *dst[k];
    d.resize(size_t(rows[k] * H));
    if (dt == DType::F32) {
      if (!d.empty()) dev::to_host(ex, d.data(), at(src, off, dt), d.size() * 4);
      continue;
    }
    for (size_t i = 0; i < d.size(); ++i)
      d[i] = dt == DType::BF16 ? bf16_to_f32(h[size_t(off) + i]) : f16_to_f32(h[size_t(off) + i]);
  }
}
}  // namespace

void DevModel::vision_features(const std::vector<VisionJob>& jobs) {
  Q3VL_CHECK(infer_ && infer_->block, "DevModel::reserve_infer must size the model before inference");
  Infer& J = *infer_;
  Q3VL_CHECK(stage_.first, "DevModel::vision_features: only the first pipeline stage holds the vision tower");
  const VisionConfig& vc = cfg_.vision;
  const int64_t H = cfg_.text.hidden, pd = vc.patch_dim(), nds = int64_t(vc.deepstack_indexes.size());
  std::vector<int64_t> grid, rows;  // rows: each prompt's merged tokens
  int64_t Np = 0;
  for (const VisionJob& v : jobs) {
    const int64_t n = image_patches(vc, v.pixels->size(), *v.grid);
    grid.insert(grid.end(), v.grid->begin(), v.grid->end());
    rows.push_back(n / (int64_t(vc.merge) * vc.merge));
    Np += n;
  }
  budget_check(Np, J.b.patches, "image patches");
  for (const VisionJob& v : jobs) v.img->clear(), v.ds->assign(size_t(nds), {});
  if (Np == 0) return;
  int64_t off = 0;  // each prompt's pixels at its first patch
  for (const VisionJob& v : jobs) {
    up_dt(ex_, at(J.vb.pixels, off * pd, dt_), v.pixels->data(), v.pixels->size(), dt_);
    off += int64_t(v.pixels->size()) / pd;
  }
  const DevParams P = dparams();
  vision_tower(ex_, cfg_, table_, P, grid, Np, J.vb, [&](int) -> DevVisionBlockCtx& { return J.vwork; }, nullptr,
               J.vscr, J.mctx, J.dsctx, dt_);
  std::vector<std::vector<float>*> dst;
  for (const VisionJob& v : jobs) dst.push_back(v.img);
  down_rows(ex_, J.vb.img, H, dt_, rows, dst);
  for (int64_t j = 0; j < nds; ++j) {
    for (size_t k = 0; k < jobs.size(); ++k) dst[k] = &(*jobs[k].ds)[size_t(j)];
    down_rows(ex_, J.vb.ds[size_t(j)], H, dt_, rows, dst);
  }
}

std::vector<float> DevModel::step(const std::vector<StepSegment<float>>& segs, KvTable& cache,
                                  const std::vector<float>* x_in, std::vector<float>* x_out, Argmax* best) {
  Q3VL_CHECK(infer_ && infer_->block, "DevModel::reserve_infer must size the model before inference");
  Infer& J = *infer_;
  Q3VL_CHECK(cache.block == J.b.block, "DevModel::step: the block tables must be in this model's block size");
  const TextConfig& tc = cfg_.text;
  const int64_t H = tc.hidden, bs = cache.block;
  const int64_t v0 = J.v0, V = J.v1 > 0 ? J.v1 - J.v0 : tc.vocab;  // this rank's vocabulary rows
  StepPhases* const ph = J.phases;
  double t_phase = ph ? wall_seconds() : 0;
  const auto phase = [&](double StepPhases::*f) {  // the time since the last phase ended goes to f
    const double t = wall_seconds();
    ph->*f += t - t_phase, t_phase = t;
  };
  StepPack<float> pk = pack_step(cfg_, segs, cache, /*features=*/false);  // uploaded from segs (up_features)
  const bool any_ds = std::any_of(segs.begin(), segs.end(), [](const StepSegment<float>& g) { return !g.ds.empty(); });
  const size_t nds = any_ds ? cfg_.vision.deepstack_indexes.size() : 0;
  const int64_t N = int64_t(pk.ids.size()), S = int64_t(pk.seqs.size()), SB = std::max<int64_t>(J.b.seq_blocks, 1);
  budget_check(N, J.b.tokens, "new tokens in one step");
  budget_check(S, J.b.segments, "sequences in one step");
  for (int64_t s = 0; s < S; ++s) {
    const int q = pk.seqs[s];
    const int64_t n = pk.cu[s + 1] - pk.cu[s];
    if (cache.room(q) < n)
      fail("KV cache: sequence " + std::to_string(q) + " holds room for " + std::to_string(cache.room(q)) +
           " more tokens, not " + std::to_string(n) + " (blocks are reserved before the step)");
    for (int32_t b : cache.table[q])
      Q3VL_CHECK(b >= 0 && b < J.b.kv_blocks, "DevModel::step: block " + std::to_string(b) + " is outside the pools");
  }
  std::vector<int32_t> vis;
  for (int64_t i = 0; i < N; ++i)
    if (cfg_.visual_token(pk.ids[i])) vis.push_back(int32_t(i));
  const int64_t nvis = int64_t(vis.size());
  // A decode step (a new token per sequence, no image rows) is padded to Sp one-token segments, each padded one of
  // context 1 whose key goes nowhere (slot -1): every size below then depends on Sp alone, which a graph needs. Its
  // contexts are bounded by a sequence's blocks, not this step's longest (the attention's key split reads each
  // segment's own length).
  const bool host_sums = J.tp && J.tp->kind() != "nccl";
  const bool decode = J.graphs && N == S && nvis == 0 && !host_sums;
  const int64_t Sp = decode ? decode_bucket(S, std::min(J.b.segments, J.b.tokens)) : S, Np = N + (Sp - S);
  if (Sp > S) {
    pk.ids.resize(size_t(Np), 0);
    for (int64_t s = S; s < Sp; ++s) pk.cu.push_back(pk.cu.back() + 1);
    std::vector<int64_t> pos(size_t(3 * Np), 0);
    for (int r = 0; r < 3; ++r) std::copy_n(&pk.pos[size_t(r * N)], N, &pos[size_t(r * Np)]);
    pk.pos.swap(pos);
  }
  // Paged metadata: each segment's context and block table, each new token's pool row (int32, as uploaded). A table
  // row is as long as the sequence's blocks; the attention reads no further than its context.
  std::vector<int32_t> ctx(Sp, 1), table(Sp * SB, 0), slots(Np, -1), last(Sp);
  int64_t max_q = 0, max_ctx = 0, keys = 0;
  for (int64_t s = 0; s < Sp; ++s) {
    last[s] = int32_t(pk.cu[s + 1] - 1);
    if (s >= S) continue;
    const int q = pk.seqs[s];
    const int64_t n = pk.cu[s + 1] - pk.cu[s], L = cache.len[q];
    ctx[s] = int32_t(L + n);
    budget_check(cache.blocks_for(ctx[s]), SB, "KV blocks for one sequence");
    std::copy(cache.table[q].begin(), cache.table[q].end(), table.begin() + s * SB);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = L + i;
      slots[pk.cu[s] + i] = int32_t(int64_t(cache.table[q][p / bs]) * bs + p % bs);
    }
    max_q = std::max(max_q, n), max_ctx = std::max<int64_t>(max_ctx, ctx[s]), keys += ctx[s];
  }
  if (decode) max_q = 1, max_ctx = SB * bs;
  std::vector<float> rope_c(Np * tc.head_dim / 2), rope_s(rope_c.size());
  ops::mrope_table(pk.pos.data(), Np, int64_t(tc.head_dim), tc.rope_theta, tc.mrope_section.data(), rope_c.data(),
                   rope_s.data());
  if (ph) phase(&StepPhases::pack);
  up32(ex_, J.ids, pk.ids), up32(ex_, J.cu, pk.cu), up32(ex_, J.ctx, ctx), up32(ex_, J.table, table);
  up32(ex_, J.slots, slots), up32(ex_, J.last, last), up32(ex_, J.vis, vis);
  dev::to_device(ex_, J.tcos, rope_c.data(), rope_c.size() * 4);
  dev::to_device(ex_, J.tsin, rope_s.data(), rope_s.size() * 4);
  if (best && !stage_.last) best = nullptr;  // only the last stage has logits
  if (best) {
    Q3VL_CHECK(int64_t(best->banned.size()) <= kMaxBanned, "DevModel::step: more than " +
                                                                std::to_string(kMaxBanned) + " banned ids");
    up32(ex_, J.banned, best->banned);
  }
  const int64_t nban = best ? int64_t(best->banned.size()) : 0, limit = best ? best->limit : 0;
  const DevParams P = dparams();
  const int l0 = stage_.l0, l1 = stage_.l1 < 0 ? tc.layers : stage_.l1;
  // The segments' features into dst in token order, part(g) of each: straight from the segments, no gathered copy.
  const std::vector<float> none;
  const auto up_features = [&](void* dst, const auto& part) {
    int64_t off = 0;
    for (const StepSegment<float>& g : segs) {
      const std::vector<float>& v = part(g);
      if (!v.empty()) up_dt(ex_, at(dst, off, dt_), v.data(), v.size(), dt_, &J.stage), off += int64_t(v.size());
    }
  };
  if (stage_.first) {
    if (nvis) up_features(J.img, [](const StepSegment<float>& g) -> const std::vector<float>& { return g.img; });
  } else {  // the previous stage's output (a padded row keeps whatever the buffer held: rows never mix)
    Q3VL_CHECK(x_in && int64_t(x_in->size()) == N * H, "DevModel::step: a later pipeline stage needs its input x_in");
    up_dt(ex_, J.x, x_in->data(), x_in->size(), dt_, &J.stage);
  }
  if (nvis)  // DeepStack features for this stage's layers
    for (size_t j = size_t(l0); j < nds && int(j) < l1; ++j)
      up_features(J.ds[j], [&](const StepSegment<float>& g) -> const std::vector<float>& { return g.ds.empty() ? none : g.ds[j]; });
  if (ph) phase(&StepPhases::upload);
  DevPartialSum reduce;
  std::unique_ptr<CommRequest> last_sum;  // NCCL: the step's latest sum, waited on before anything leaves the device
  if (J.tp && !host_sums)
    reduce = [&](void* y, int64_t n) { last_sum = J.tp->iall_reduce(y, y, size_t(n), dt_, ReduceOp::Sum); };
  else if (J.tp)  // fp32 through the host: [n] dt -> F32 -> host -> sum over the group -> back
    reduce = [&](void* y, int64_t n) {
      J.host_red.resize(size_t(n));
      dev::convert(ex_, J.red, DType::F32, y, dt_, n);
      dev::to_host(ex_, J.host_red.data(), J.red, size_t(n) * 4);
      J.tp->all_reduce(J.host_red.data(), size_t(n), DType::F32);
      dev::to_device(ex_, J.red, J.host_red.data(), size_t(n) * 4);
      dev::convert(ex_, y, dt_, J.red, DType::F32, n);
    };
  // Everything on the device from the token ids to the logits: a decode step's graph, or run as it is enqueued.
  auto body = [&] {
    if (stage_.first) {
      dev::embedding_fwd(ex_, J.ids, pp_[table_.embed_tokens()], J.x, Np, H, tc.vocab, dt_);
      if (nvis) dev::scatter_rows(ex_, J.img, J.vis, J.x, nvis, H, false, dt_);
    }
    const void* pending = nullptr;  // a layer's MLP output, added with the next layer's first norm
    DevQkvAhead ahead;              // a layer's chain may compute the next one's qkv (a layer of its kind: one J.dwork)
    for (int l = l0; l < l1; ++l) {
      const bool moe = table_.moe_layer(l), deepstack = size_t(l) < nds && nvis;
      const DevPagedCache kv{J.k[l], J.v[l], J.slots, J.cu, J.ctx, J.table, SB, bs, Sp, max_q, max_ctx, keys};
      ahead.next = l + 1 < l1 && !deepstack && moe == table_.moe_layer(l + 1) ? table_.layer(l + 1) : -1;
      const bool added = dev_decoder_infer(ex_, cfg_, P, table_.layer(l), moe, J.x, Np, kv, J.tcos, J.tsin,
                                           moe ? J.probs : nullptr, moe ? J.idx : nullptr, J.dwork[moe], J.dscr,
                                           reduce, pending, ahead, dt_);
      pending = added ? nullptr : J.dscr.tmp;
      if (deepstack) {
        if (pending) dev::axpy(ex_, 1.f, pending, J.x, Np * H, dt_), pending = nullptr;
        dev::scatter_rows(ex_, J.ds[l], J.vis, J.x, nvis, H, true, dt_);
      }
    }
    Q3VL_CHECK(ahead.links.empty(), "DevModel::step: a decode chain was left unlaunched");
    if (pending) dev::axpy(ex_, 1.f, pending, J.x, Np * H, dt_);
    if (!stage_.last) return;
    // Final norm and the LM head (this rank's rows) on each segment's last row only.
    dev::gather_rows(ex_, J.x, J.last, 1, J.hb, Sp, H, dt_);
    dev::rmsnorm_fwd(ex_, J.hb, pp_[table_.final_norm()], J.hf, J.rf, Sp, H, tc.rms_eps, dt_);
    dev_linear(ex_, P, table_.lm_head(), J.hf, J.lg, Sp, H, V, dt_, v0);
    dev::convert(ex_, J.lgf, DType::F32, J.lg, dt_, Sp * V);
    if (best) dev::argmax_rows(ex_, J.lgf, Sp, V, v0, limit, J.banned, nban, J.bidx, J.bval);
  };
  void* graph = nullptr;
  // A profiled step runs its ops one by one. Under tensor parallelism with NCCL sums (Q3VL_TP_GRAPHS=1, off until it is
  // measured on GPUs) the graph holds the group's sums too: the requests made while recording are dropped, and one
  // fence behind the launch is waited on instead (every rank records and replays the same steps, so the group's
  // collectives stay in one order). Host sums cannot be recorded.
  const bool tp_graphs = J.tp && env_is("Q3VL_TP_GRAPHS", "1");
  if (decode && (!J.tp || (tp_graphs && !host_sums)) && !J.graphs_failed && !ph) {
    const std::array<int64_t, 4> key{Sp, best != nullptr, limit, nban};
    auto it = J.graph.find(key);
    if (it != J.graph.end()) {
      graph = it->second;
    } else if (dev::capture_begin(ex_)) {
      try {
        body();
      } catch (...) {
        dev::graph_destroy(ex_, dev::capture_end(ex_));
        throw;
      }
      graph = dev::capture_end(ex_);
      last_sum.reset();  // its event was recorded into the graph
      if (graph) J.graph[key] = graph;
      else J.graphs_failed = true, log_warn("the device refused to record a decode step as a graph: steps run op by op");
    }
  }
  if (graph) {
    dev::graph_launch(ex_, graph);
    if (J.tp) last_sum = J.tp->ifence("nccl sums of a decode step's graph");
  } else {
    body();
  }
  for (int64_t s = 0; s < S; ++s) cache.len[pk.seqs[s]] += pk.cu[s + 1] - pk.cu[s];
  // Before anything leaves the device: the group's sums are done (or the watchdog names who is missing).
  if (last_sum) J.tp->wait(std::move(last_sum));
  if (ph) dev::synchronize(ex_), phase(&StepPhases::device);
  const auto downloaded = [&] {
    if (ph) phase(&StepPhases::download);
  };
  if (!stage_.last) {  // the next stage's input
    Q3VL_CHECK(x_out, "DevModel::step: a pipeline stage before the last needs x_out");
    x_out->resize(size_t(N * H));
    down_f32(ex_, x_out->data(), J.x, x_out->size(), dt_);
    downloaded();
    return {};
  }
  if (best) {
    best->id.resize(size_t(S)), best->val.resize(size_t(S));
    dev::to_host(ex_, best->id.data(), J.bidx, size_t(S) * 4);
    dev::to_host(ex_, best->val.data(), J.bval, size_t(S) * 4);
    downloaded();
    return {};
  }
  std::vector<float> logits(size_t(S * V));
  dev::to_host(ex_, logits.data(), J.lgf, logits.size() * 4);
  downloaded();
  return logits;
}

}  // namespace q3vl
