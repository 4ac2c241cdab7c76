// Model assembly on the device op layer (spec 1-5), the same sequence as qwen3vl.cpp's BasicModel::run/backward.
// Host work per forward is the small metadata only: token ids, targets, segment offsets, rotary tables, the rows of
// image tokens and of supervised targets, uploaded once into buffers carved at reserve().
#include "q3vl/model/dev_model.hpp"

#include <algorithm>
#include <cmath>

#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_vision.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

namespace {
constexpr int64_t kHeadRows = 1024;  // LM-head chunk: [rows, V] logits exist at a time, never [N, V]

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
  int32_t *ids, *cu, *vis, *sup, *sup_t, *head_t, *vcu;
  float *tcos, *tsin, *vcos, *vsin;
  // Streams and gradients (dt unless noted).
  void *x, *hf, *dh, *dx, *hb, *lg, *dlg, *dhb, *pixels, *vx, *dv, *img, *dimg;
  std::vector<void*> ds, dds;
  float *rf, *rowloss, *probs, *aux_f;
  int32_t* idx;
  void* aux_dl;
  double* sums;  // [0] CE sum, [1] aux sum
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
    head_rows = std::min(T, kHeadRows);
    dctx.assign(recompute ? 0 : tc.layers, {});
    for (int l = 0; l < int(dctx.size()); ++l) dctx[l].carve(a, tc, t.moe_layer(l), T, dt);
    dxin.assign(recompute ? tc.layers : 0, nullptr);
    for (auto& p : dxin) p = a.take(T * H, dt);
    if (recompute) {
      bool kinds[2] = {false, false};
      for (int l = 0; l < tc.layers; ++l) kinds[t.moe_layer(l)] = true;
      for (int m = 0; m < 2; ++m)
        if (kinds[m]) dwork[m].carve(a, tc, m == 1, T, dt);
    }
    dscr.carve(a, tc, nmoe > 0, T, dt);
    ids = a.take<int32_t>(T, DType::I32), cu = a.take<int32_t>(b.segments + 1, DType::I32);
    vis = a.take<int32_t>(T, DType::I32), sup = a.take<int32_t>(T, DType::I32), sup_t = a.take<int32_t>(T, DType::I32);
    head_t = a.take<int32_t>(T, DType::I32);
    tcos = a.take<float>(T * tc.head_dim / 2, DType::F32), tsin = a.take<float>(T * tc.head_dim / 2, DType::F32);
    x = a.take(T * H, dt), hf = a.take(T * H, dt), dh = a.take(T * H, dt), dx = a.take(T * H, dt);
    hb = a.take(head_rows * H, dt), dhb = a.take(head_rows * H, dt);
    lg = a.take(head_rows * V, dt), dlg = a.take(head_rows * V, dt);
    rf = a.take<float>(T, DType::F32), rowloss = a.take<float>(head_rows, DType::F32);
    probs = a.take<float>(std::max<int64_t>(1, nmoe * T * E), DType::F32);
    idx = a.take<int32_t>(std::max<int64_t>(1, nmoe * T * K), DType::I32);
    aux_dl = a.take(std::max<int64_t>(1, nmoe * T * E), dt);
    aux_f = a.take<float>(std::max<int64_t>(1, E), DType::F32);
    sums = a.take<double>(2, DType::F64);
    // Vision tower (only when the budget has patches).
    vctx.assign(P && !recompute ? vc.depth : 0, {});
    vxin.assign(P && recompute ? vc.depth : 0, nullptr);
    dsctx.assign(P ? nds : 0, {});
    ds.assign(nds, nullptr), dds.assign(nds, nullptr);
    pixels = vx = dv = img = dimg = nullptr, vcos = vsin = nullptr, vcu = nullptr;
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
  }
};

DevModel::DevModel(const ModelConfig& cfg, const dev::Exec& ex, DType dt)
    : cfg_(cfg), table_(cfg), ex_(ex), dt_(dt), impl_(std::make_unique<Impl>()) {
  if (ex.device == Device::CPU && dt != DType::F32)
    fail_all(std::string("model.dtype = ") + dtype_name(dt) + " needs model.backend = \"cuda\" (the CPU computes fp32)");
  params_ = dev::alloc(ex_, size_t(weight_bytes(table_, dt_)));
  grads_ = static_cast<float*>(dev::alloc(ex_, size_t(grad_bytes(table_))));
  for (const ParamInfo& p : table_.params()) {
    const int64_t off = table_.units()[p.unit].offset + p.offset;
    pp_.push_back(at(params_, off, dt_));
    gp_.push_back(grads_ + off);
  }
  zero_grads();
}

DevModel::~DevModel() {
  dev::synchronize(ex_);
  if (impl_->block) dev::release(ex_, impl_->block);
  dev::release(ex_, params_);
  dev::release(ex_, grads_);
}

void DevModel::set_recompute(bool on) {
  Q3VL_CHECK(!impl_->block, "DevModel::set_recompute comes before reserve()");
  recompute_ = impl_->recompute = on;
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

DevMemory DevModel::plan(const ModelConfig& cfg, DType dt, const DevBudget& b, bool recompute, int64_t ws_bytes) {
  const ParamTable t(cfg);
  DevMemory m;
  m.weights = weight_bytes(t, dt);
  m.grads = grad_bytes(t);
  m.activations = activation_bytes(cfg, dt, b, recompute);
  m.workspace = ws_bytes;
  return m;
}

void DevModel::reserve(const DevBudget& b) {
  Q3VL_CHECK(!impl_->block, "DevModel::reserve is called once");
  impl_->bytes = size_arena(*impl_, cfg_, dt_, b, impl_->recompute);
  impl_->block = dev::alloc(ex_, impl_->bytes);
  Arena a{static_cast<char*>(impl_->block), impl_->bytes};
  impl_->carve(a, cfg_, dt_);
}

DevMemory DevModel::memory() const {
  DevMemory m;
  m.weights = weight_bytes(table_, dt_);
  m.grads = grad_bytes(table_);
  m.activations = int64_t(impl_->bytes);
  m.workspace = int64_t(ex_.ws_bytes);
  return m;
}

void DevModel::set_params(const float* host_all) {
  const int64_t n = table_.total();
  if (dt_ == DType::F32) return dev::to_device(ex_, params_, host_all, size_t(n) * 4);
  // Through the gradient buffer as fp32 staging (it is zeroed again after).
  dev::to_device(ex_, grads_, host_all, size_t(n) * 4);
  dev::convert(ex_, params_, dt_, grads_, DType::F32, n);
  zero_grads();
}
void DevModel::set_params_from_device(const float* f32) { dev::convert(ex_, params_, dt_, f32, DType::F32, table_.total()); }
void DevModel::zero_grads() { dev::fill(ex_, grads_, DType::F32, table_.total(), 0.f); }
void DevModel::grads_to_host(float* host_all) const {
  dev::to_host(ex_, host_all, grads_, size_t(table_.total()) * 4);
}

double DevModel::forward(const Batch& b, bool keep, std::vector<float>* logits_out, double* aux_out, bool aux_loss) {
  return run(token_stream(b), b.pixel_values, b.image_grid_thw, keep, logits_out, aux_out, aux_loss);
}
double DevModel::forward(const PackedBatch& b, bool keep, std::vector<float>* logits_out, double* aux_out,
                         bool aux_loss) {
  return run(token_stream(b), b.pixel_values, b.image_grid_thw, keep, logits_out, aux_out, aux_loss);
}

namespace {
void up32(const dev::Exec& ex, int32_t* dst, const std::vector<int64_t>& v) {
  const std::vector<int32_t> w(v.begin(), v.end());
  dev::to_device(ex, dst, w.data(), w.size() * 4);
}
void budget_check(int64_t need, int64_t have, const char* what) {
  if (need > have)
    fail("the batch needs " + std::to_string(need) + " " + what + ", the model was sized for " + std::to_string(have) +
         " (train.seq_len / micro-batch / image limits)");
}
}  // namespace

double DevModel::run(TokenStream&& s, const std::vector<float>& pixels, const std::vector<int64_t>& grid, bool keep,
                     std::vector<float>* logits_out, double* aux_out, bool aux_loss) {
  Impl& I = *impl_;
  Q3VL_CHECK(I.block, "DevModel::reserve must size the model before a forward");
  const VisionConfig& vc = cfg_.vision;
  const TextConfig& tc = cfg_.text;
  const DevParams P{pp_.data(), gp_.data()};
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
  {
    const auto pos = mrope_positions(cfg_, I.st.ids.data(), I.st.cu, grid);
    std::vector<float> c(N * tc.head_dim / 2), sn(c.size());
    ops::mrope_table(pos.data(), N, int64_t(tc.head_dim), tc.rope_theta, tc.mrope_section.data(), c.data(), sn.data());
    dev::to_device(ex_, I.tcos, c.data(), c.size() * 4);
    dev::to_device(ex_, I.tsin, sn.data(), sn.size() * 4);
  }
  std::vector<int64_t> vis, sup, sup_t;
  for (int64_t i = 0; i < N; ++i) {
    if (I.st.ids[i] == cfg_.image_token_id) vis.push_back(i);
    if (I.st.targets[i] != -100) sup.push_back(i), sup_t.push_back(I.st.targets[i]);
  }
  if (int64_t(vis.size()) * 4 != I.Np)
    fail("image features and image tokens do not match: " + std::to_string(vis.size()) + " tokens with id " +
         std::to_string(cfg_.image_token_id) + ", " + std::to_string(I.Np / 4) + " merged image features");
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
    const std::vector<int64_t> vcu = vision_cu_seqlens(grid);
    I.vseg = int64_t(vcu.size()) - 1;
    I.vmax = 0;
    for (int64_t k = 0; k < I.vseg; ++k) I.vmax = std::max(I.vmax, vcu[k + 1] - vcu[k]);
    up32(ex_, I.vcu, vcu);
    std::vector<int64_t> row, col;
    vision_patch_coords(grid, vc.merge, row, col);
    std::vector<float> c(I.Np * vc.head_dim() / 2), sn(c.size());
    ops::vision_rope_table(row.data(), col.data(), I.Np, int64_t(vc.head_dim()), c.data(), sn.data());
    dev::to_device(ex_, I.vcos, c.data(), c.size() * 4);
    dev::to_device(ex_, I.vsin, sn.data(), sn.size() * 4);
    // Pixels arrive as fp32 and are rounded to dt on the host (the batch is on the host anyway).
    if (dt_ == DType::F32) {
      dev::to_device(ex_, I.pixels, pixels.data(), pixels.size() * 4);
    } else {
      std::vector<uint16_t> h(pixels.size());
      if (dt_ == DType::BF16) f32_to_bf16(pixels.data(), int64_t(pixels.size()), h.data());
      else std::transform(pixels.begin(), pixels.end(), h.begin(), [](float v) { return f32_to_f16(v); });
      dev::to_device(ex_, I.pixels, h.data(), h.size() * 2);
    }
    const DevSegments vs{I.vcu, I.vseg, I.vmax};
    dev_vision_embed_fwd(ex_, vc, P, table_.vision_embed(), I.pixels, grid, I.Np, I.vx, dt_);
    for (int i = 0; i < vc.depth; ++i) {
      if (recompute_) dev::copy(ex_, I.vxin[i], I.vx, size_t(I.Np * vc.hidden) * dtype_size(dt_));
      dev_vision_block_fwd(ex_, vc, P, table_.vision_block(i), I.vx, I.Np, vs, I.vcos, I.vsin,
                           recompute_ ? I.vwork : I.vctx[i], I.vscr, dt_);
      for (size_t j = 0; j < nds; ++j)
        if (vc.deepstack_indexes[j] == i)
          dev_merger_fwd(ex_, vc, P, table_.deepstack_merger(j), true, I.vx, I.Np, I.ds[j], I.dsctx[j], dt_);
    }
    dev_merger_fwd(ex_, vc, P, table_.merger(), false, I.vx, I.Np, I.img, I.mctx, dt_);
  }

  // Token embeddings with the image features over the image tokens.
  dev::embedding_fwd(ex_, I.ids, pp_[table_.embed_tokens()], I.x, N, H, V, dt_);
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
    dev_decoder_fwd(ex_, cfg_, P, table_.layer(l), moe, I.x, N, seg, I.tcos, I.tsin, pr, ix,
                    recompute_ ? I.dwork[moe] : I.dctx[l], I.dscr, dt_);
    if (size_t(l) < nds && I.nvis) dev::scatter_rows(ex_, I.ds[l], I.vis, I.x, I.nvis, H, true, dt_);
  }

  // Final norm (I.x is its input, kept), LM head and loss.
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
      dev::cross_entropy(ex_, I.lg, I.head_t + r0, I.rowloss, nullptr, I.sums, n, V, 0.f, dt_);
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
      dev::cross_entropy(ex_, I.lg, I.sup_t + r0, I.rowloss, nullptr, I.sums, n, V, 0.f, dt_);
    }
  }
  const int64_t nmoe = slot;
  if (nmoe > 0) dev::aux_loss_fwd(ex_, I.probs, I.idx, I.aux_f, I.sums + 1, nmoe * N, E, K);
  double sums[2];
  dev::to_host(ex_, sums, I.sums, sizeof sums);
  double loss = count_ ? sums[0] / double(count_) : 0.0;
  if (aux_out) *aux_out = sums[1];
  if (aux_loss) loss += tc.router_aux_loss_coef * sums[1];
  aux_on_ = aux_loss && nmoe > 0;
  kept_ = keep;
  return loss;
}

void DevModel::backward(float loss_scale) {
  if (!kept_) fail("DevModel::backward called without a forward(keep_for_backward=true) before it");
  kept_ = false;
  Impl& I = *impl_;
  const VisionConfig& vc = cfg_.vision;
  const TextConfig& tc = cfg_.text;
  const DevParams P{pp_.data(), gp_.data()};
  const int64_t N = I.N, H = tc.hidden, V = tc.vocab, E = tc.num_experts, K = tc.experts_per_tok;
  const size_t nds = vc.deepstack_indexes.size();

  // LM head: recompute each chunk's logits, d(CE)/d(logits), then the head's input and weight gradients.
  dev::fill(ex_, I.dh, dt_, N * H, 0.f);
  const void* W = pp_[table_.lm_head()];
  for (int64_t r0 = 0; r0 < I.nsup; r0 += I.head_rows) {
    const int64_t n = std::min(I.head_rows, I.nsup - r0);
    dev::gather_rows(ex_, I.hf, I.sup + r0, 1, I.hb, n, H, dt_);
    dev::linear_fwd(ex_, I.hb, W, nullptr, I.lg, n, H, V, dt_);
    dev::fill(ex_, I.dlg, dt_, n * V, 0.f);
    dev::cross_entropy(ex_, I.lg, I.sup_t + r0, I.rowloss, I.dlg, nullptr, n, V,
                       float(loss_scale / double(I.nsup)), dt_);
    dev::fill(ex_, I.dhb, dt_, n * H, 0.f);
    dev::linear_bwd(ex_, I.dlg, I.hb, W, I.dhb, gp_[table_.lm_head()], nullptr, n, H, V, dt_);
    dev::scatter_rows(ex_, I.dhb, I.sup + r0, I.dh, n, H, false, dt_);
  }
  dev::fill(ex_, I.dx, dt_, N * H, 0.f);
  dev::rmsnorm_bwd(ex_, I.dh, I.x, pp_[table_.final_norm()], I.rf, I.dx, gp_[table_.final_norm()], N, H, dt_);

  int64_t nmoe = 0;
  for (int l = 0; l < tc.layers; ++l) nmoe += table_.moe_layer(l);
  if (aux_on_) {
    dev::fill(ex_, I.aux_dl, dt_, nmoe * N * E, 0.f);
    dev::aux_loss_bwd(ex_, I.probs, I.aux_f, float(tc.router_aux_loss_coef * loss_scale), I.aux_dl, nmoe * N, E, dt_);
  }
  const DevSegments seg{I.cu, I.nseg, I.max_len};
  int64_t slot = nmoe;
  for (int l = tc.layers - 1; l >= 0; --l) {
    if (size_t(l) < nds && I.nvis) dev::gather_rows(ex_, I.dx, I.vis, 1, I.dds[l], I.nvis, H, dt_);
    const bool moe = table_.moe_layer(l);
    slot -= moe;
    const float* pr = moe ? I.probs + slot * N * E : nullptr;
    const int32_t* ix = moe ? I.idx + slot * N * K : nullptr;
    const void* adl = moe && aux_on_ ? at(I.aux_dl, slot * N * E, dt_) : nullptr;
    DevDecoderCtx* c = recompute_ ? &I.dwork[moe] : &I.dctx[l];
    if (recompute_)  // rerun into the shared context; probs/idx get the values they already hold
      dev_decoder_fwd(ex_, cfg_, P, table_.layer(l), moe, I.dxin[l], N, seg, I.tcos, I.tsin, const_cast<float*>(pr),
                      const_cast<int32_t*>(ix), *c, I.dscr, dt_);
    dev_decoder_bwd(ex_, cfg_, P, table_.layer(l), moe, I.dx, N, seg, I.tcos, I.tsin, pr, ix, adl, *c, I.dscr, dt_);
  }
  // Image positions were overwritten by the image features: their rows go to the merger, not the embedding.
  if (I.nvis) {
    dev::gather_rows(ex_, I.dx, I.vis, 1, I.dimg, I.nvis, H, dt_);
    dev::fill(ex_, I.dh, dt_, I.nvis * H, 0.f);
    dev::scatter_rows(ex_, I.dh, I.vis, I.dx, I.nvis, H, false, dt_);
  }
  dev::embedding_bwd(ex_, I.ids, I.dx, gp_[table_.embed_tokens()], N, H, dt_);

  if (I.Np > 0) {
    const DevSegments vs{I.vcu, I.vseg, I.vmax};
    dev::fill(ex_, I.dv, dt_, I.Np * vc.hidden, 0.f);
    dev_merger_bwd(ex_, vc, P, table_.merger(), false, I.dimg, I.Np, I.dv, I.mctx, I.mscr, dt_);
    for (int i = vc.depth - 1; i >= 0; --i) {
      for (size_t j = 0; j < nds; ++j)
        if (vc.deepstack_indexes[j] == i && j < size_t(tc.layers))
          dev_merger_bwd(ex_, vc, P, table_.deepstack_merger(j), true, I.dds[j], I.Np, I.dv, I.dsctx[j], I.mscr, dt_);
      DevVisionBlockCtx* c = recompute_ ? &I.vwork : &I.vctx[i];
      if (recompute_)
        dev_vision_block_fwd(ex_, vc, P, table_.vision_block(i), I.vxin[i], I.Np, vs, I.vcos, I.vsin, *c, I.vscr, dt_);
      dev_vision_block_bwd(ex_, vc, P, table_.vision_block(i), I.dv, I.Np, vs, I.vcos, I.vsin, *c, I.vscr, dt_);
    }
    dev_vision_embed_bwd(ex_, vc, P, table_.vision_embed(), I.pixels, I.grid, I.Np, I.dv, dt_);
  }
}

}  // namespace q3vl
