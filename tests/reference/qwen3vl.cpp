// Model assembly (spec 1-5): the forward keeps per-layer contexts; the backward walks them in reverse.
#include "qwen3vl.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "q3vl/core/debug.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

template <class T>
BasicModel<T>::BasicModel(const ModelConfig& cfg, bool with_storage, ExpertSplit ep) : cfg_(cfg), table_(cfg, ep) {
  if (with_storage) {
    store_p_.assign(table_.total(), T(0));
    store_g_.assign(table_.total(), T(0));
  }
  for (const auto& u : table_.units()) {
    unit_p_.push_back(with_storage ? store_p_.data() + u.offset : nullptr);
    unit_g_.push_back(with_storage ? store_g_.data() + u.offset : nullptr);
  }
  int slot = 0;
  for (int l = 0; l < cfg.text.layers; ++l) moe_slot_.push_back(table_.moe_layer(l) ? slot++ : -1);
  lora_.table = &table_;
  lora_.scale = cfg.lora.scale();
  lora_.dropout = cfg.lora.dropout;
  rebind();
}

const char* low_dtype_name(LowDtype d) {
  switch (d) {
    case LowDtype::I8: return "int8";
    case LowDtype::BF16: return "bf16";
    case LowDtype::F16: return "fp16";
    case LowDtype::FP8: return "fp8";
  }
  return "?";
}

std::vector<bool> low_params(const ParamTable& t) {
  std::vector<bool> q(t.params().size(), false);
  for (int l = 0; l < t.config().text.layers; ++l) {
    const int f = t.layer(l);
    for (int i : {tlay::q_proj, tlay::k_proj, tlay::v_proj, tlay::o_proj}) q[f + i] = true;
    if (t.moe_layer(l)) q[t.experts(l)] = q[t.experts(l) + 1] = true;  // gate_up, down
    else q[f + tlay::gate_proj] = q[f + tlay::up_proj] = q[f + tlay::down_proj] = true;
  }
  q[t.lm_head()] = true;  // tied: the embedding table too
  return q;
}

template <class T>
void BasicModel<T>::need_fp32(const char* what) const {
  if (lowered()) {
    const std::string d = low_dtype_name(low_.front().dtype);
    fail(std::string(what) + ": the model holds " + d + " weights (model.weight_dtype = \"" + d +
         "\"), for inference only");
  }
}

namespace {
// Parameter `name`'s n weights W (fp32) into dt at out (int8, fp8: rows of `cols` with their scales).
void lower_param(LowDtype dt, const std::string& name, const float* W, int64_t n, int64_t cols, char* out,
                 float* scale) {
  int64_t bad = -1;
  switch (dt) {
    case LowDtype::I8: case LowDtype::FP8: return ops::quantize_rows(low_qformat(dt), W, n / cols, cols, out, scale);
    case LowDtype::BF16: bad = ops::round_to(W, n, reinterpret_cast<Bf16*>(out)); break;
    case LowDtype::F16: bad = ops::round_to(W, n, reinterpret_cast<Fp16*>(out)); break;
  }
  if (bad < 0) return;
  const std::string d = low_dtype_name(dt), at = "model.weight_dtype = \"" + d + "\": parameter " + name + " holds ";
  if (!std::isfinite(W[bad])) fail(at + "a non-finite weight at element " + std::to_string(bad));
  fail(at + std::to_string(W[bad]) + " at element " + std::to_string(bad) + ", beyond " + d + "'s range" +
       (dt == LowDtype::F16 ? " (|w| < 65520); use \"bf16\" (fp32's range) or \"fp32\"" : ""));
}
}  // namespace

template <class T>
typename BasicModel<T>::WeightBytes BasicModel<T>::lower_weights(LowDtype dt) {
  need_fp32("lower_weights");
  need_all_experts("lower_weights");
  if (store_p_.empty()) fail("lower_weights: the model has no weights of its own (ZeRO-bound units)");
  const std::vector<bool> q = low_params(table_);
  const int64_t esize = low_scaled(dt) ? 1 : 2;
  WeightBytes b;
  int64_t nq = 0, rows = 0, kept = 0;
  for (size_t id = 0; id < q.size(); ++id) {
    const ParamInfo& p = table_.params()[id];
    if (q[id]) nq += p.numel, rows += p.numel / p.shape.back();
    else kept += p.numel;
  }
  if (!low_scaled(dt)) rows = 0;  // no scales
  std::vector<char> store(nq * esize);
  std::vector<float> scales(rows);
  std::vector<LowWeight> views(q.size(), LowWeight{dt});  // every entry names dt (need_fp32 reads the first)
  std::vector<T> keep(kept);
  std::vector<T*> pp = pp_;
  // In id order, so that gate_proj and up_proj stay adjacent (the fused [gate; up] product). Into new storage, and
  // the model changed only once every parameter converted: a refused weight leaves it as it was.
  for (size_t id = 0, oq = 0, os = 0, ok = 0; id < q.size(); ++id) {
    const ParamInfo& p = table_.params()[id];
    if (!q[id]) {
      std::copy(pp_[id], pp_[id] + p.numel, keep.data() + ok);
      pp[id] = keep.data() + ok;
      ok += p.numel;
      continue;
    }
    const int64_t cols = p.shape.back();
    float* sc = low_scaled(dt) ? scales.data() + os : nullptr;
    if constexpr (std::is_same_v<T, float>) {
      lower_param(dt, p.name, pp_[id], p.numel, cols, store.data() + oq * esize, sc);
    } else {  // the double model of the gradient checks
      const std::vector<float> w(pp_[id], pp_[id] + p.numel);
      lower_param(dt, p.name, w.data(), p.numel, cols, store.data() + oq * esize, sc);
    }
    views[id] = {dt, store.data() + oq * esize, sc};
    pp[id] = nullptr;
    oq += p.numel, os += sc ? p.numel / cols : 0;
  }
  b.fp32 = (int64_t)store_p_.size() * (int64_t)sizeof(float);
  b.low = nq * esize, b.scales = rows * (int64_t)sizeof(float), b.kept = kept * (int64_t)sizeof(float);
  low_store_.swap(store), low_scales_.swap(scales), low_.swap(views), pp_.swap(pp);
  // The fp32 masters and every gradient go: inference needs neither.
  store_p_.swap(keep);
  std::vector<T>().swap(keep);
  std::fill(unit_p_.begin(), unit_p_.end(), nullptr);
  drop_gradients();
  return b;
}

template <class T>
void BasicModel<T>::drop_gradients() {
  std::vector<T>().swap(store_g_);
  std::fill(unit_g_.begin(), unit_g_.end(), nullptr);
  std::fill(gp_.begin(), gp_.end(), nullptr);
}

template <class T>
void BasicModel<T>::rebind() {
  need_fp32("rebind");
  pp_.resize(table_.params().size());
  gp_.resize(table_.params().size());
  for (size_t i = 0; i < pp_.size(); ++i) {
    const ParamInfo& p = table_.params()[i];
    pp_[i] = unit_p_[p.unit] ? unit_p_[p.unit] + p.offset : nullptr;
    gp_[i] = unit_g_[p.unit] && (trainable_.empty() || trainable_[i]) ? unit_g_[p.unit] + p.offset : nullptr;
  }
}

template <class T>
void BasicModel<T>::bind_unit(int unit, T* params, T* grads) {
  need_fp32("bind_unit");
  Q3VL_CHECK(unit >= 0 && unit < (int)unit_p_.size(), "bind_unit: no such unit");
  unit_p_[unit] = params;
  unit_g_[unit] = grads;
  for (int id : table_.units()[unit].params) {  // only this unit's pointers: ZeRO-3 binds twice per use
    pp_[id] = params ? params + table_.params()[id].offset : nullptr;
    gp_[id] = grads && (trainable_.empty() || trainable_[size_t(id)]) ? grads + table_.params()[id].offset : nullptr;
  }
}

template <class T>
void BasicModel<T>::release_storage() {
  need_fp32("release_storage");
  std::vector<T>().swap(store_p_);
  std::vector<T>().swap(store_g_);
  std::fill(unit_p_.begin(), unit_p_.end(), nullptr);
  std::fill(unit_g_.begin(), unit_g_.end(), nullptr);
  rebind();
}

template <class T>
void BasicModel<T>::enter(int id, bool bwd) {
  debug_stop_point(bwd ? "backward" : "forward");  // test hook, off unless runtime.debug_stop_rank is set
  if (!hooks_) return;
  const int u = table_.params()[id].unit;
  bwd ? hooks_->before_backward(u) : hooks_->before_forward(u);
}

template <class T>
void BasicModel<T>::leave(int id, bool bwd) {
  if (!hooks_) return;
  const int u = table_.params()[id].unit;
  bwd ? hooks_->after_backward(u) : hooks_->after_forward(u);
}

template <class T>
void BasicModel<T>::enter_layer(int l, bool bwd) {
  enter(table_.layer(l), bwd);
  if (table_.experts(l) >= 0) enter(table_.experts(l), bwd);
}

template <class T>
void BasicModel<T>::leave_layer(int l, bool bwd) {
  if (table_.experts(l) >= 0) leave(table_.experts(l), bwd);
  leave(table_.layer(l), bwd);
}

template <class T>
void BasicModel<T>::set_experts(ExpertExchange* ex) {
  Q3VL_CHECK(!ex || ex->size() == table_.ep().size, "the expert exchange's group is not the parameter table's split");
  ex_ = ex;
}

template <class T>
void BasicModel<T>::need_all_experts(const char* what) const {
  if (table_.ep().size > 1 && !ex_)
    fail(std::string(what) + " needs every expert on this rank, or an expert exchange (parallel.ep > 1 in train only)");
}

template <class T>
void BasicModel<T>::idle_pass(bool backward) {
  if (!ex_) return;
  const ParamView<T> P = view();
  const TextConfig& tc = cfg_.text;
  if (!backward) idle_.assign(tc.layers, {});
  for (int i = 0; i < tc.layers; ++i) {
    const int l = backward ? tc.layers - 1 - i : i;
    if (table_.experts(l) < 0) continue;
    enter(table_.experts(l), backward);
    MoeCtx<T>& c = idle_[l];
    c.ex = ex_;
    c.recomputed = backward;
    if (!backward || recompute_) moe_fwd<T>(tc, P, table_.layer(l), nullptr, 0, nullptr, nullptr, nullptr, c);
    if (backward) moe_bwd<T>(tc, P, table_.layer(l), nullptr, nullptr, 0, nullptr, nullptr, nullptr, nullptr, c);
    if (backward) c = {};
    leave(table_.experts(l), backward);
  }
}

template <class T>
std::vector<int> BasicModel<T>::unit_order(bool backward) const {
  return q3vl::unit_order(table_, backward);
}

template <class T>
void BasicModel<T>::zero_grads() {
  for (size_t u = 0; u < unit_g_.size(); ++u)
    if (unit_g_[u]) std::fill(unit_g_[u], unit_g_[u] + table_.units()[u].numel, T(0));
}

template <class T>
void BasicModel<T>::init_random(uint64_t seed, double std) {
  need_fp32("init_random");
  for (size_t i = 0; i < pp_.size(); ++i) {
    const ParamInfo& p = table_.params()[i];
    init_param_range(p, seed, std, p.held_begin, p.held, pp_[i]);
  }
}

template <class T>
double BasicModel<T>::forward(const Batch& b, bool keep, std::vector<T>* logits_out, double* aux_out, bool aux_loss) {
  return run(token_stream(b), b.pixel_values, b.image_grid_thw, keep, logits_out, aux_out, aux_loss);
}

template <class T>
double BasicModel<T>::forward(const PackedBatch& b, bool keep, std::vector<T>* logits_out, double* aux_out,
                              bool aux_loss) {
  return run(token_stream(b), b.pixel_values, b.image_grid_thw, keep, logits_out, aux_out, aux_loss);
}

template <class T>
void BasicModel<T>::encode_images(const std::vector<float>& pixels, const std::vector<int64_t>& grid, bool keep,
                                  std::vector<T>& img, std::vector<std::vector<T>>& ds) {
  const VisionConfig& vc = cfg_.vision;
  const ParamView<T> P = view();
  const int64_t H = cfg_.text.hidden, Dv = vc.hidden;
  const int64_t Np = image_patches(vc, pixels.size(), grid);
  const size_t nds = vc.deepstack_indexes.size();
  img.assign(Np / 4 * H, T(0));
  ds.assign(nds, std::vector<T>(Np / 4 * H));
  const bool slim = keep && recompute_;
  vctx_.assign(keep ? vc.depth : 1, {});
  dsctx_.resize(nds);
  if (Np == 0) return;
  pixels_.assign(pixels.begin(), pixels.end());
  std::vector<T> vx(Np * Dv);
  enter(table_.vision_embed(), false);
  vision_embed_fwd(vc, P, table_.vision_embed(), pixels_.data(), grid, Np, vx.data());
  leave(table_.vision_embed(), false);
  std::vector<int64_t> row, col;
  vision_patch_coords(grid, vc.merge, row, col);
  vcos_.resize(Np * vc.head_dim() / 2);
  vsin_.resize(vcos_.size());
  ops::vision_rope_table(row.data(), col.data(), Np, (int64_t)vc.head_dim(), vcos_.data(), vsin_.data());
  vcu_ = vision_cu_seqlens(grid);
  for (int i = 0; i < vc.depth; ++i) {
    enter(table_.vision_block(i), false);
    VisionBlockCtx<T>& c = slim ? vscratch_ : vctx_[keep ? i : 0];
    vision_block_fwd(vc, P, table_.vision_block(i), vx.data(), Np, vcu_, vcos_.data(), vsin_.data(), c);
    if (slim) vctx_[i].x.swap(c.x);  // recompute: the block's input is all its backward needs kept
    leave(table_.vision_block(i), false);
    for (size_t j = 0; j < nds; ++j)
      if (vc.deepstack_indexes[j] == i) {
        enter(table_.deepstack_merger(j), false);
        merger_fwd(vc, P, table_.deepstack_merger(j), true, vx.data(), Np, ds[j].data(), dsctx_[j]);
        leave(table_.deepstack_merger(j), false);
      }
  }
  enter(table_.merger(), false);
  merger_fwd(vc, P, table_.merger(), false, vx.data(), Np, img.data(), mctx_);
  leave(table_.merger(), false);
  if (keep) act_peak_ = std::max(act_peak_, activation_bytes());
  vscratch_ = {};
}

template <class T>
std::vector<T> BasicModel<T>::embed(const std::vector<int64_t>& ids, const std::vector<T>& img) {
  const int64_t N = (int64_t)ids.size(), H = cfg_.text.hidden;
  std::vector<T> x(N * H);
  enter(table_.embed_tokens(), false);
  if (const LowWeight* w = view().lowp(table_.embed_tokens()))  // tied to the low-precision head: a row is a token
    w->visit([&](const auto* rows) {
      ops::embedding_lowp_fwd(ids.data(), rows, w->scale, x.data(), N, H, (int64_t)cfg_.text.vocab);
    });
  else
    ops::embedding_fwd(ids.data(), view().p[table_.embed_tokens()], x.data(), N, H, (int64_t)cfg_.text.vocab);
  leave(table_.embed_tokens(), false);
  // Image tokens are replaced by the image features, row-major over the batch, in pixel_values order.
  vis_.clear();
  for (int64_t i = 0; i < N; ++i)
    if (cfg_.visual_token(ids[i])) vis_.push_back(i);
  if ((int64_t)vis_.size() * H != (int64_t)img.size())
    fail("image features and image tokens do not match: " + std::to_string(vis_.size()) + " tokens with id " +
         std::to_string(cfg_.image_token_id) + ", " + std::to_string(img.size() / H) + " merged image features");
  for (size_t j = 0; j < vis_.size(); ++j) std::copy(&img[j * H], &img[(j + 1) * H], &x[vis_[j] * H]);
  return x;
}

template <class T>
double BasicModel<T>::run(Stream&& s, const std::vector<float>& pixels, const std::vector<int64_t>& grid, bool keep,
                          std::vector<T>* logits_out, double* aux_out, bool aux_loss) {
  need_all_experts("forward");
  if (keep) need_fp32("a training forward");
  const VisionConfig& vc = cfg_.vision;
  const TextConfig& tc = cfg_.text;
  const ParamView<T> P = view();
  const int64_t N = (int64_t)s.ids.size(), H = tc.hidden, V = tc.vocab;
  kept_ = false;
  st_ = std::move(s);
  grid_ = grid;

  const size_t nds = vc.deepstack_indexes.size();
  std::vector<T> img;
  std::vector<std::vector<T>> ds;
  encode_images(pixels, grid, keep, img, ds);
  std::vector<T> x = embed(st_.ids, img);

  // Decoder.
  const auto pos = mrope_positions(cfg_, st_.ids.data(), st_.cu, grid);
  tcos_.resize(N * tc.head_dim / 2);
  tsin_.resize(tcos_.size());
  ops::mrope_table(pos.data(), N, (int64_t)tc.head_dim, tc.rope_theta, tc.mrope_section.data(), tcos_.data(),
                   tsin_.data());
  const int nmoe = (int)std::count_if(moe_slot_.begin(), moe_slot_.end(), [](int v) { return v >= 0; });
  const int64_t E = tc.num_experts, K = tc.experts_per_tok;
  probs_.resize(nmoe * N * E);
  idx_.resize(nmoe * N * K);
  const bool slim = keep && recompute_;
  dctx_.assign(keep ? tc.layers : 1, {});
  for (int l = 0; l < tc.layers; ++l) {
    const int ms = moe_slot_[l];
    enter_layer(l, false);
    DecoderCtx<T>& c = slim ? dscratch_ : dctx_[keep ? l : 0];
    c.moe.ex = ex_;
    c.moe.recomputed = false;
    decoder_layer_fwd(cfg_, P, table_.layer(l), ms >= 0, x.data(), N, st_.cu, tcos_.data(), tsin_.data(),
                      ms >= 0 ? probs_.data() + ms * N * E : nullptr, ms >= 0 ? idx_.data() + ms * N * K : nullptr, c);
    if (slim) dctx_[l].x.swap(c.x);
    leave_layer(l, false);
    if ((size_t)l < nds)  // DeepStack: add merged features of ViT block deepstack_indexes[l] at visual positions
      for (size_t j = 0; j < vis_.size(); ++j)
        for (int64_t d = 0; d < H; ++d) x[vis_[j] * H + d] += ds[l][j * H + d];
  }

  // Final norm, LM head, loss.
  xf_ = x;
  hf_.resize(N * H);
  rf_.resize(N);
  enter(table_.final_norm(), false);
  ops::rmsnorm_fwd(xf_.data(), P.p[table_.final_norm()], hf_.data(), rf_.data(), N, H, tc.rms_eps);
  count_ = std::count_if(st_.targets.begin(), st_.targets.end(), [](int64_t t) { return t != -100; });
  std::vector<T> logits;
  if (logits_out) logits.resize(N * V);
  const bool tied_head = table_.params()[table_.lm_head()].unit != table_.params()[table_.final_norm()].unit;
  if (tied_head) enter(table_.lm_head(), false);
  const double ce = lm_head_loss_fwd(P, table_.lm_head(), hf_.data(), st_.targets.data(), N, H, V,
                                     logits_out ? logits.data() : nullptr);
  if (tied_head) leave(table_.lm_head(), false);
  leave(table_.final_norm(), false);
  if (logits_out) {
    logits_out->assign(st_.out_rows * V, T(0));
    for (int64_t i = 0; i < N; ++i) std::copy(&logits[i * V], &logits[(i + 1) * V], &(*logits_out)[st_.orig[i] * V]);
  }
  double loss = count_ ? ce / (double)count_ : 0.0;
  double aux = 0;
  aux_f_.assign(E, T(0));
  if (nmoe > 0) aux = ops::aux_loss_fwd(probs_.data(), idx_.data(), nmoe * N, E, K, aux_f_.data());
  if (aux_out) *aux_out = aux;
  if (aux_loss) loss += tc.router_aux_loss_coef * aux;
  aux_on_ = aux_loss && nmoe > 0;
  kept_ = keep;
  act_peak_ = std::max(act_peak_, activation_bytes());
  if (!keep) {  // nothing of this pass may be used by a backward
    vctx_.clear();
    dctx_.clear();
  }
  dscratch_ = {};
  vscratch_ = {};
  return loss;
}

template <class T>
std::vector<T> BasicModel<T>::extend(std::vector<T>& x, const std::vector<int64_t>& cu, const std::vector<int64_t>& pos3,
                                     const std::vector<int>& seqs, const std::vector<std::vector<T>>& ds,
                                     HostKvCache<T>& cache) {
  if (table_.ep().size > 1) fail("generation needs every expert on this rank (parallel.ep = 1)");
  const TextConfig& tc = cfg_.text;
  const ParamView<T> P = view();
  const int64_t N = cu.back(), H = tc.hidden, nseg = (int64_t)seqs.size();
  const int64_t v0 = head_v0_, V = head_v1_ > 0 ? head_v1_ - head_v0_ : tc.vocab;  // this rank's vocabulary rows
  for (int64_t s = 0; s < nseg; ++s)
    if (!cache.reserve(seqs[s], cu[s + 1] - cu[s]))
      fail("KV cache full: " + std::to_string(cache.max_blocks) + " blocks of " + std::to_string(cache.block) +
           " tokens are in use");
  std::vector<T> cos(N * tc.head_dim / 2), sin(cos.size());
  ops::mrope_table(pos3.data(), N, (int64_t)tc.head_dim, tc.rope_theta, tc.mrope_section.data(), cos.data(),
                   sin.data());
  for (int l = 0; l < tc.layers; ++l) {
    enter_layer(l, false);
    decoder_layer_infer(cfg_, P, table_.layer(l), moe_slot_[l] >= 0, x.data(), N, cu, seqs, cos.data(), sin.data(),
                        cache, l, tp_reduce_);
    leave_layer(l, false);
    if ((size_t)l < ds.size())  // DeepStack, as in run(): only prompts hold visual tokens
      for (size_t j = 0; j < vis_.size(); ++j)
        for (int64_t d = 0; d < H; ++d) x[vis_[j] * H + d] += ds[l][j * H + d];
  }
  for (int64_t s = 0; s < nseg; ++s) cache.len[seqs[s]] += cu[s + 1] - cu[s];
  // Final norm and LM head on each segment's last row only.
  std::vector<T> last(nseg * H), h(nseg * H), r(nseg), logits(nseg * V);
  for (int64_t s = 0; s < nseg; ++s) std::copy(&x[(cu[s + 1] - 1) * H], &x[cu[s + 1] * H], &last[s * H]);
  const bool tied_head = table_.params()[table_.lm_head()].unit != table_.params()[table_.final_norm()].unit;
  enter(table_.final_norm(), false);
  if (tied_head) enter(table_.lm_head(), false);
  ops::rmsnorm_fwd(last.data(), P.p[table_.final_norm()], h.data(), r.data(), nseg, H, tc.rms_eps);
  param_linear(P, table_.lm_head(), v0, h.data(), logits.data(), nseg, H, V);
  lora_fwd(P, table_.lm_head(), h.data(), nseg, logits.data(), V, v0, V);  // this rank's rows of B
  if (tied_head) leave(table_.lm_head(), false);
  leave(table_.final_norm(), false);
  return logits;
}

template <class T>
std::vector<T> BasicModel<T>::prefill(const std::vector<std::vector<int64_t>>& prompts,
                                      const std::vector<float>& pixels, const std::vector<int64_t>& grid,
                                      HostKvCache<T>& cache) {
  kept_ = false;  // the shared buffers below no longer describe a training forward
  const int B = (int)prompts.size();
  std::vector<int64_t> ids, cu{0};
  std::vector<int> seqs(B);
  for (int b = 0; b < B; ++b) {
    if (prompts[b].empty()) fail("prefill: prompt " + std::to_string(b) + " is empty");
    ids.insert(ids.end(), prompts[b].begin(), prompts[b].end());
    cu.push_back((int64_t)ids.size());
    seqs[b] = b;
  }
  std::vector<T> img;
  std::vector<std::vector<T>> ds;
  encode_images(pixels, grid, false, img, ds);
  std::vector<T> x = embed(ids, img);
  const std::vector<int64_t> pos = mrope_positions(cfg_, ids.data(), cu, grid);
  const int64_t N = (int64_t)ids.size();
  cache.reset(cfg_.text.layers, (int64_t)cfg_.text.kv_heads * cfg_.text.head_dim);
  for (int b = 0; b < B; ++b) cache.add();
  for (int b = 0; b < B; ++b)
    for (int row = 0; row < 3; ++row)
      for (int64_t i = cu[b]; i < cu[b + 1]; ++i) cache.next_pos[b] = std::max(cache.next_pos[b], pos[row * N + i] + 1);
  std::vector<T> logits = extend(x, cu, pos, seqs, ds, cache);
  vctx_.clear();
  return logits;
}

template <class T>
std::vector<T> BasicModel<T>::decode(const std::vector<int>& seqs, const std::vector<int64_t>& tokens,
                                     HostKvCache<T>& cache) {
  kept_ = false;
  const int64_t n = (int64_t)seqs.size();
  if ((int64_t)tokens.size() != n) fail("decode: " + std::to_string(tokens.size()) + " tokens for " + std::to_string(n) + " sequences");
  std::vector<int64_t> cu(n + 1), pos(3 * n);
  for (int64_t i = 0; i < n; ++i) {
    if (seqs[i] < 0 || seqs[i] >= cache.batch()) fail("decode: no cached sequence " + std::to_string(seqs[i]));
    if (tokens[i] == cfg_.image_token_id || tokens[i] == cfg_.video_token_id)
      fail("decode: image and video tokens can only come with their pixels in a prompt");
    cu[i + 1] = i + 1;
    pos[i] = pos[n + i] = pos[2 * n + i] = cache.next_pos[seqs[i]]++;
  }
  std::vector<T> x = embed(tokens, {});
  return extend(x, cu, pos, seqs, {}, cache);
}

template <class T>
void BasicModel<T>::vision_features(const std::vector<float>& pixels, const std::vector<int64_t>& grid,
                                    std::vector<T>& img, std::vector<std::vector<T>>& ds) {
  kept_ = false;
  encode_images(pixels, grid, false, img, ds);
  vctx_.clear();
}

template <class T>
std::vector<T> BasicModel<T>::step(const std::vector<StepSegment<T>>& segs, HostKvCache<T>& cache) {
  kept_ = false;
  StepPack<T> k = pack_step(cfg_, segs, cache);
  std::vector<T> x = embed(k.ids, k.img);
  return extend(x, k.cu, k.pos, k.seqs, k.ds, cache);
}

template <class T>
void BasicModel<T>::backward() {
  if (!kept_) fail("Model::backward called without a forward(keep_for_backward=true) before it");
  kept_ = false;
  const VisionConfig& vc = cfg_.vision;
  const TextConfig& tc = cfg_.text;
  const ParamView<T> P = view();
  const int64_t N = (int64_t)st_.ids.size(), H = tc.hidden, V = tc.vocab, Dv = vc.hidden;
  const int64_t E = tc.num_experts, K = tc.experts_per_tok;
  const size_t nds = vc.deepstack_indexes.size();

  std::vector<T> dh(N * H), dx(N * H);
  const bool tied_head = table_.params()[table_.lm_head()].unit != table_.params()[table_.final_norm()].unit;
  enter(table_.final_norm(), true);
  if (tied_head) enter(table_.lm_head(), true);
  if (count_)
    lm_head_loss_bwd(P, table_.lm_head(), hf_.data(), st_.targets.data(), N, H, V, T(1.0 / (double)count_),
                     dh.data());
  if (tied_head) leave(table_.lm_head(), true);
  ops::rmsnorm_bwd(dh.data(), xf_.data(), P.p[table_.final_norm()], rf_.data(), dx.data(), P.g[table_.final_norm()], N,
                   H);
  leave(table_.final_norm(), true);
  std::vector<T> aux_dl;
  if (aux_on_) {
    const int64_t rows = (int64_t)probs_.size() / E;
    aux_dl.assign(rows * E, T(0));
    ops::aux_loss_bwd(probs_.data(), aux_f_.data(), T(tc.router_aux_loss_coef), aux_dl.data(), rows, E);
  }
  std::vector<std::vector<T>> dds(nds);
  for (int l = tc.layers - 1; l >= 0; --l) {
    if ((size_t)l < nds) {
      dds[l].resize(vis_.size() * H);
      for (size_t j = 0; j < vis_.size(); ++j) std::copy(&dx[vis_[j] * H], &dx[(vis_[j] + 1) * H], &dds[l][j * H]);
    }
    const int ms = moe_slot_[l];
    T* probs = ms >= 0 ? probs_.data() + ms * N * E : nullptr;
    int64_t* idx = ms >= 0 ? idx_.data() + ms * N * K : nullptr;
    enter_layer(l, true);
    DecoderCtx<T>* c = &dctx_[l];
    if (recompute_) {  // rewrites probs/idx with the values they already hold
      std::vector<T> xin = std::move(dctx_[l].x);  // freed after this backward anyway
      dscratch_.moe.ex = ex_;
      dscratch_.moe.recomputed = true;
      decoder_layer_fwd(cfg_, P, table_.layer(l), ms >= 0, xin.data(), N, st_.cu, tcos_.data(), tsin_.data(), probs,
                        idx, dscratch_);
      c = &dscratch_;
      act_peak_ = std::max(act_peak_, activation_bytes());
    }
    decoder_layer_bwd(cfg_, P, table_.layer(l), ms >= 0, dx.data(), N, st_.cu, tcos_.data(), tsin_.data(), probs, idx,
                      ms >= 0 && aux_on_ ? aux_dl.data() + ms * N * E : nullptr, *c);
    dctx_[l] = {};  // done with this layer's activations
    leave_layer(l, true);
  }
  // Image positions were overwritten by the vision tokens: their embedding rows get no gradient.
  std::vector<T> dimg(vis_.size() * H);
  for (size_t j = 0; j < vis_.size(); ++j) {
    std::copy(&dx[vis_[j] * H], &dx[(vis_[j] + 1) * H], &dimg[j * H]);
    std::fill(&dx[vis_[j] * H], &dx[(vis_[j] + 1) * H], T(0));
  }
  enter(table_.embed_tokens(), true);
  ops::embedding_bwd(st_.ids.data(), dx.data(), P.g[table_.embed_tokens()], N, H);
  leave(table_.embed_tokens(), true);

  const int64_t Np = (int64_t)vis_.size() * 4;
  if (Np > 0) {
    std::vector<T> dv(Np * Dv);
    enter(table_.merger(), true);
    merger_bwd(vc, P, table_.merger(), false, dimg.data(), Np, dv.data(), mctx_);
    leave(table_.merger(), true);
    for (int i = vc.depth - 1; i >= 0; --i) {
      for (size_t j = 0; j < nds; ++j)
        if (vc.deepstack_indexes[j] == i && j < (size_t)tc.layers) {
          enter(table_.deepstack_merger(j), true);
          merger_bwd(vc, P, table_.deepstack_merger(j), true, dds[j].data(), Np, dv.data(), dsctx_[j]);
          leave(table_.deepstack_merger(j), true);
        }
      enter(table_.vision_block(i), true);
      VisionBlockCtx<T>* c = &vctx_[i];
      if (recompute_) {
        std::vector<T> xin = std::move(vctx_[i].x);
        vision_block_fwd(vc, P, table_.vision_block(i), xin.data(), Np, vcu_, vcos_.data(), vsin_.data(), vscratch_);
        c = &vscratch_;
        act_peak_ = std::max(act_peak_, activation_bytes());
      }
      vision_block_bwd(vc, P, table_.vision_block(i), dv.data(), Np, vcu_, vcos_.data(), vsin_.data(), *c);
      vctx_[i] = {};
      leave(table_.vision_block(i), true);
    }
    enter(table_.vision_embed(), true);
    vision_embed_bwd(vc, P, table_.vision_embed(), pixels_.data(), grid_, Np, dv.data());
    leave(table_.vision_embed(), true);
  }
  vctx_.clear();
  dctx_.clear();
  dscratch_ = {};
  vscratch_ = {};
}

template <class T>
int64_t BasicModel<T>::activation_bytes() const {
  int64_t b = vscratch_.bytes() + dscratch_.bytes() + mctx_.bytes();
  for (const auto& c : vctx_) b += c.bytes();
  for (const auto& c : dctx_) b += c.bytes();
  for (const auto& c : dsctx_) b += c.bytes();
  return b + vec_bytes(pixels_, vcos_, vsin_, tcos_, tsin_, xf_, hf_, rf_, probs_, idx_);
}

template class BasicModel<float>;
template class BasicModel<double>;

}  // namespace q3vl
