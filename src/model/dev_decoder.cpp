// Text decoder layer on the device op layer (spec 4.3, 4.4, 4.7, 4.8): RMSNorm -> GQA attention with QK-norm and
// M-RoPE -> residual; RMSNorm -> dense SwiGLU MLP or MoE block -> residual. The op sequence is decoder.cpp's, so on
// the CPU in fp32 it computes what the templated layer computes.
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "q3vl/core/env.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_layers.hpp"
#include "q3vl/model/params.hpp"

namespace q3vl {

void* Arena::take(size_t bytes) {
  const size_t start = (used + 255) & ~size_t(255);  // 256-byte alignment: vector loads, cuBLASLt
  used = start + bytes;
  if (!base) return nullptr;
  Q3VL_CHECK(used <= cap, "arena of " + std::to_string(cap) + " bytes overrun (sizing and carving disagree)");
  return base + start;
}

void DevDecoderCtx::carve(Arena& a, const TextConfig& tc, bool moe, int64_t N, DType dt, int ep) {
  const int64_t H = tc.hidden, Dq = int64_t(tc.heads) * tc.head_dim, Dk = int64_t(tc.kv_heads) * tc.head_dim;
  // qkv: the fused q_proj | k_proj | v_proj rows (dev::qkv_to_cache_fwd reads them); q, k and v the attention's
  // inputs, each [N, heads, hd].
  x = a.take(N * H, dt), ln1 = a.take(N * H, dt), qkv = a.take(N * (Dq + 2 * Dk), dt);
  q = a.take(N * Dq, dt), k = a.take(N * Dk, dt), v = a.take(N * Dk, dt), att = a.take(N * Dq, dt);
  x1 = a.take(N * H, dt), ln2 = a.take(N * H, dt);
  r1 = a.take<float>(N, DType::F32), rq = a.take<float>(N * tc.heads, DType::F32);
  rk = a.take<float>(N * tc.kv_heads, DType::F32), lse = a.take<float>(N * tc.heads, DType::F32);
  r2 = a.take<float>(N, DType::F32);
  gu = act = egu = ey = nullptr, w = nullptr, start = rows = pos = nullptr;
  if (!moe) {
    gu = a.take(N * 2 * tc.intermediate, dt), act = a.take(N * tc.intermediate, dt);
  } else {
    const int64_t R = N * tc.experts_per_tok, Ro = ep * R;  // Ro: every rank of the group sends its R rows here
    w = a.take<float>(R, DType::F32);
    start = a.take<int32_t>(tc.num_experts + 1, DType::I32);
    rows = a.take<int32_t>(R, DType::I32), pos = a.take<int32_t>(R, DType::I32);
    egu = a.take(Ro * 2 * tc.moe_intermediate, dt), ey = a.take(R * H, dt);
    xo = nullptr, perm = ostart = nullptr, ro_cap = Ro;
    if (ep > 1)
      xo = a.take(Ro * H, dt), perm = a.take<int32_t>(Ro, DType::I32),
      ostart = a.take<int32_t>(tc.num_experts / ep + 1, DType::I32);
  }
}

void DevDecoderScratch::carve(Arena& a, const TextConfig& tc, bool moe, int64_t N, DType dt, int ep) {
  const int64_t H = tc.hidden, Dq = int64_t(tc.heads) * tc.head_dim, Dk = int64_t(tc.kv_heads) * tc.head_dim;
  tmp = a.take(N * H, dt), dln = a.take(N * H, dt), datt = a.take(N * Dq, dt);
  dq = a.take(N * Dq, dt), dk = a.take(N * Dk, dt), dv = a.take(N * Dk, dt);
  dqkv = a.take(N * (Dq + 2 * Dk), dt);
  dact = a.take(N * tc.intermediate, dt), dgu = a.take(N * 2 * tc.intermediate, dt);
  logits = xg = eact = dyg = edact = edgu = dxg = dlogits = nullptr, dw = nullptr;
  arr = yo = nullptr;
  if (moe) {
    const int64_t R = N * tc.experts_per_tok, Ro = ep * R, E = tc.num_experts, Im = tc.moe_intermediate;
    logits = a.take<float>(N * E, DType::F32), dlogits = a.take<float>(N * E, DType::F32);  // the router: fp32
    dw = a.take<float>(R, DType::F32);
    xg = a.take(R * H, dt), eact = a.take(Ro * Im, dt), dyg = a.take(R * H, dt);
    edact = a.take(Ro * Im, dt), edgu = a.take(Ro * 2 * Im, dt), dxg = a.take(R * H, dt);
    if (ep > 1) arr = a.take(Ro * H, dt), yo = a.take(Ro * H, dt);
  }
}

void dev_linear(const dev::Exec& ex, const DevParams& P, int id, const void* x, void* y, int64_t N, int64_t n_in,
                int64_t n_out, DType dt, int64_t row0, const dev::RowsIn& rin, bool add) {
  if (P.q8 && P.q8[id])
    return dev::linear_q8_fwd(ex, x, P.q8[id] + row0 * n_in, P.s8[id] + row0, nullptr, y, N, n_in, n_out, P.qf, dt,
                              rin, add);
  dev::linear_fwd(ex, x, at(P.p[id], row0 * n_in, dt), nullptr, y, N, n_in, n_out, dt, rin, add);
}

bool dev_grad_adds(const dev::Exec& ex, const DevParams& P, std::initializer_list<int> ids) {
  if (P.sq_at)
    for (int id : ids) P.sq_at[id] = nullptr;
  if (!P.fresh) return true;
  int live = 0, fresh = 0;
  for (int id : ids)
    if (P.g[id]) ++live, fresh += P.fresh[id];
  if (live > 0 && fresh == live) {
    for (int id : ids) P.fresh[id] = 0;
    return false;
  }
  for (int id : ids) dev_grad_zeroed(ex, P, id);
  return true;
}
void dev_grad_zeroed(const dev::Exec& ex, const DevParams& P, int id) {
  if (P.sq_at) P.sq_at[id] = nullptr;
  if (!P.fresh || !P.g[id] || !P.fresh[id]) return;
  dev::fill(ex, P.g[id], DType::F32, P.numel[id], 0.f);
  P.fresh[id] = 0;
}

DevGradOut dev_grad_out(const dev::Exec& ex, const DevParams& P, int id) {
  const bool adds = dev_grad_adds(ex, P, {id});
  if (!P.sq_sum || !P.sq_at || adds || !P.g[id]) return {adds, {}};
  P.sq_at[id] = P.g[id];
  return {adds, {P.sq_sum + id, P.sq_bad + id}};
}

int dev_experts_id(const DevParams& P, int f) {
  if (!P.lora) return f + tlay::experts_gate_up;
  const ParamTable& t = *P.lora->table;
  for (int l = 0; l < t.config().text.layers; ++l)
    if (t.layer(l) == f) return t.experts(l);
  fail("dev_decoder: parameter " + std::to_string(f) + " starts no decoder layer");
}

namespace {
// The experts' product, in 8 bits when the model holds them so (serving with model.weight_dtype = "int8" or "fp8").
void grouped_linear(const dev::Exec& ex, const DevParams& P, int id, const void* xg, const int32_t* start, void* y,
                    int64_t R, int64_t E, int64_t n_in, int64_t n_out, DType dt, const dev::RowsIn& rin) {
  if (P.q8 && P.q8[id])
    return dev::grouped_linear_q8_fwd(ex, xg, P.q8[id], P.s8[id], start, y, R, E, n_in, n_out, P.qf, dt, rin);
  dev::grouped_linear_fwd(ex, xg, P.p[id], start, y, R, E, n_in, n_out, dt, rin);
}
// Consecutive linears of a layer run as one matrix: the table keeps them adjacent, and so do the device model's 8-bit
// rows and scales and the gradients. rows: each one's output rows; returns the first one's id.
int fused(const DevParams& P, int first, std::initializer_list<int64_t> rows, int64_t n_in, DType dt,
          const std::string& what) {
  int id = first;
  for (auto r = rows.begin(); r + 1 != rows.end(); ++r, ++id) {
    if (P.q8 && P.q8[first])
      Q3VL_CHECK(P.q8[id + 1] == P.q8[id] + *r * n_in && P.s8[id + 1] == P.s8[id] + *r,
                 "8-bit " + what + " must be adjacent");
    else
      Q3VL_CHECK(P.p[id + 1] == at(P.p[id], *r * n_in, dt), what + " must be adjacent");
    Q3VL_CHECK(!P.g[id] || P.g[id + 1] == P.g[id] + *r * n_in, what + " grads must be adjacent");
  }
  return first;
}
// The dense MLP's gate and up as one [2I, H] matrix. Returns gate_proj's id.
int fused_gate_up(const DevParams& P, int f, int64_t I, int64_t H, DType dt) {
  return fused(P, f + tlay::gate_proj, {I, I}, H, dt, "gate_proj/up_proj");
}
void zero(const dev::Exec& ex, void* p, int64_t n, DType dt) { dev::fill(ex, p, dt, n, 0.f); }
// q_proj, k_proj and v_proj as one [Dq + 2 Dk, H] matrix (the table keeps them adjacent). Returns q_proj's id.
int fused_qkv(const DevParams& P, int f, int64_t Dq, int64_t Dk, int64_t H, DType dt) {
  return fused(P, f + tlay::q_proj, {Dq, Dk, Dk}, H, dt, "q_proj/k_proj/v_proj");
}
// The attention's inputs: c.ln1 -> the fused projection's rows c.qkv -> q, k (QK-norm, M-RoPE) and v.
void qkv_fwd(const dev::Exec& ex, const TextConfig& tc, const DevParams& P, int f, int64_t N, const float* cos,
             const float* sin, DevDecoderCtx& c, DType dt) {
  const int64_t H = tc.hidden, nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim, Dq = nh * hd, Dk = nkv * hd;
  const int64_t ld = Dq + 2 * Dk;
  dev_linear(ex, P, fused_qkv(P, f, Dq, Dk, H, dt), c.ln1, c.qkv, N, H, ld, dt);
  dev_lora_fwd(ex, P, f + tlay::q_proj, c.ln1, N, c.qkv, ld, dt);
  dev_lora_fwd(ex, P, f + tlay::k_proj, c.ln1, N, at(c.qkv, Dq, dt), ld, dt);
  dev_lora_fwd(ex, P, f + tlay::v_proj, c.ln1, N, at(c.qkv, Dq + Dk, dt), ld, dt);
  dev::qkv_to_cache_fwd(ex, c.qkv, P.p[f + tlay::q_norm], P.p[f + tlay::k_norm], c.q, c.k, c.v, nullptr, c.rq, c.rk,
                        cos, sin, N, nh, nkv, hd, tc.rms_eps, dt);
}
// How a decode step's MLP folds its neighbours (dev_decoder_infer): the dense gate_up reads `norm_x` through the
// layer's post-attention norm instead of reading c.ln2; down_proj or the MoE combine adds its output to `add_to`
// instead of writing s.tmp.
struct MlpFold {
  const void* norm_x = nullptr;
  void* add_to = nullptr;
};
// A MoE block's arguments (dev::ChainMoe): the decode chain's MoE link, and mlp_fwd's where it runs that link's ops.
dev::ChainMoe moe_args(const TextConfig& tc, const DevParams& P, int f, float* probs, int32_t* idx,
                       DevDecoderCtx& c, DevDecoderScratch& s) {
  const int eg = dev_experts_id(P, f);
  return {P.p[f + tlay::router], P.p[eg],    P.p[eg + 1], tc.num_experts, tc.experts_per_tok, tc.moe_intermediate,
          static_cast<float*>(s.logits), probs, c.w, idx, c.start, c.rows, c.pos, s.xg, c.egu, s.eact, c.ey};
}
// The second half of a layer's forward: c.ln2 -> dense SwiGLU MLP or MoE block -> s.tmp [N,H].
void mlp_fwd(const dev::Exec& ex, const TextConfig& tc, const DevParams& P, int f, bool moe, int64_t N, float* probs,
             int32_t* idx, DevDecoderCtx& c, DevDecoderScratch& s, DType dt, const MlpFold& fold = {}) {
  const int64_t H = tc.hidden;
  if (moe) {
    const int64_t E = tc.num_experts, k = tc.experts_per_tok, Im = tc.moe_intermediate, R = N * k;
    const int eg = dev_experts_id(P, f);
    if (!dev_lora_on(P, f + tlay::router) && !c.ex && !c.el && !(P.q8 && (P.q8[eg] || P.q8[eg + 1]))) {
      // no router adapter, no expert parallelism, experts in dt: the ops of the decode chain's MoE link
      const dev::ChainMoe m = moe_args(tc, P, f, probs, idx, c, s);
      dev::ChainLink l;
      l.in = c.ln2, l.y = fold.add_to ? fold.add_to : s.tmp, l.n_in = l.n_out = H, l.add = fold.add_to != nullptr;
      l.moe = &m;
      return dev::chain_moe_ops(ex, l, N, dt);
    }
    // The router in fp32 under bf16/fp16 compute (Megatron's advice for MoE stability; autocast keeps its softmax in
    // fp32): logits written in fp32 by the GEMM (its dt operands, fp32 accumulation), softmax, top-k and the combine
    // weights from them in fp32. Rounding the logits to bf16 flipped near-tied top-k choices and moved the weights.
    // Without an adapter on the router the three are one op (one kernel in decode steps: dev::moe_route).
    if (dev_lora_on(P, f + tlay::router)) {  // the adapter adds to the logits before the softmax
      dev::gemm(ex, false, true, N, E, H, 1.f, c.ln2, H, P.p[f + tlay::router], H, 0.f, s.logits, E, dt, DType::F32);
      dev_lora_fwd(ex, P, f + tlay::router, c.ln2, N, s.logits, E, dt, 0, -1, 0, /*y_f32=*/true);
      dev::router_fwd(ex, s.logits, probs, idx, c.w, N, E, k, DType::F32);
      dev::moe_plan(ex, idx, N, k, E, c.start, c.rows, c.pos);
    } else {
      dev::moe_route(ex, c.ln2, P.p[f + tlay::router], static_cast<float*>(s.logits), probs, idx, c.w, c.start,
                     c.rows, c.pos, N, H, E, k, dt);
    }
    if (c.ex) {  // expert parallelism: the routed rows go to their experts' owners
      dev::gather_rows(ex, c.ln2, c.rows, k, s.xg, R, H, dt);
      return dev_moe_experts_fwd(ex, tc, P, f, N, c, s, dt);
    }
    // The routed rows and the SwiGLU as the experts' GEMVs read them in decode steps (else written to s.xg, s.eact:
    // nothing reads them after this, the backward gathers and recomputes its own).
    // Under serve.ep only the buckets of this rank's experts (c.start's rows are absolute), the others' rows zero.
    const int64_t El = c.el ? c.el : E;
    const int32_t* start = c.start + (c.el ? c.e0 : 0);
    if (c.el) zero(ex, c.ey, R * H, dt);
    grouped_linear(ex, P, eg, c.ln2, start, c.egu, R, El, H, 2 * Im, dt, {c.rows, k, false, s.xg});
    grouped_linear(ex, P, eg + 1, c.egu, start, c.ey, R, El, Im, H, dt, {nullptr, 1, true, s.eact});
    dev::moe_combine_fwd(ex, c.ey, c.pos, c.w, fold.add_to ? fold.add_to : s.tmp, N, k, H, dt,
                         fold.add_to != nullptr);
  } else {
    const int64_t I = tc.intermediate;
    const dev::RowsIn norm{nullptr, 1, false, c.ln2, P.p[f + tlay::post_norm], float(tc.rms_eps)};
    dev_linear(ex, P, fused_gate_up(P, f, I, H, dt), fold.norm_x ? fold.norm_x : c.ln2, c.gu, N, H, 2 * I, dt, 0,
               fold.norm_x ? norm : dev::RowsIn{});
    dev_lora_fwd(ex, P, f + tlay::gate_proj, c.ln2, N, c.gu, 2 * I, dt);  // gate: columns [0, I) of gu
    dev_lora_fwd(ex, P, f + tlay::up_proj, c.ln2, N, at(c.gu, I, dt), 2 * I, dt);
    // 8-bit down_proj weights (serving) read the SwiGLU of gu as they stream in decode steps; c.act is then not
    // written, which only a LoRA adapter or a backward would read (neither runs with 8-bit weights).
    const bool fuse = P.q8 && P.q8[f + tlay::down_proj] && !P.lora;
    if (!fuse) dev::swiglu_fwd(ex, c.gu, c.act, N, I, dt);
    dev_linear(ex, P, f + tlay::down_proj, fuse ? c.gu : c.act, fold.add_to ? fold.add_to : s.tmp, N, I, H, dt, 0,
               fuse ? dev::RowsIn{nullptr, 1, true, c.act} : dev::RowsIn{}, fold.add_to != nullptr);
    dev_lora_fwd(ex, P, f + tlay::down_proj, c.act, N, s.tmp, H, dt);
  }
}
}  // namespace

void dev_decoder_fwd(const dev::Exec& ex, const ModelConfig& cfg, const DevParams& P, int f, bool moe, void* x,
                     int64_t N, const DevSegments& seg, const float* cos, const float* sin, float* probs,
                     int32_t* idx, DevDecoderCtx& c, DevDecoderScratch& s, DType dt) {
  const TextConfig& tc = cfg.text;
  const int64_t H = tc.hidden, nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim, Dq = nh * hd;
  // The residual stream x: saved for the backward (c.x, c.x1) by the norms that read it, not by copies of their own.
  dev::residual_rmsnorm_fwd(ex, nullptr, x, P.p[f + tlay::in_norm], c.ln1, c.x, c.r1, N, H, tc.rms_eps, dt);
  qkv_fwd(ex, tc, P, f, N, cos, sin, c, dt);
  dev::attention_fwd(ex, c.q, c.k, c.v, c.att, c.lse, seg.cu, seg.nseg, seg.max_len, N, nh, nkv, hd, true,
                     float(1 / std::sqrt(double(hd))), dt);
  dev_linear(ex, P, f + tlay::o_proj, c.att, s.tmp, N, Dq, H, dt);
  dev_lora_fwd(ex, P, f + tlay::o_proj, c.att, N, s.tmp, H, dt);
  dev::residual_rmsnorm_fwd(ex, s.tmp, x, P.p[f + tlay::post_norm], c.ln2, c.x1, c.r2, N, H, tc.rms_eps, dt);
  mlp_fwd(ex, tc, P, f, moe, N, probs, idx, c, s, dt);
  dev::axpy(ex, 1.f, s.tmp, x, N * H, dt);
}

namespace {
bool q8(const DevParams& P, int id) { return P.q8 && P.q8[id]; }

// Whether a dense layer's o_proj, gate_up and down_proj in decode-sized steps run as one dev::linear_chain
// (Q3VL_DECODE_CHAIN=0: never), with the next layer's qkv where the caller asks for it; and whether the attention
// runs as the chain's first link (a chain of its own in other layers; Q3VL_CHAIN_ATTN=0: its two ops before the
// chain). On an H200 the link and the chained layers took one 8B fp8 stream from 3.64 to 3.36 ms a token, bf16 from
// 5.21 to 4.97 (docs/PERFORMANCE.md, thirty-third session).
bool chain_on() {
  static const bool on = !env_is("Q3VL_DECODE_CHAIN", "0");
  return on;
}
bool chain_attn_on() { return chain_on() && dev_chain_attn(); }
// Whether such chains of consecutive layers are one (Q3VL_CHAIN_LAYERS=1: a chain a layer).
bool chain_layers_on() {
  static const bool layers = !env_is("Q3VL_CHAIN_LAYERS", "1");
  return chain_attn_on() && layers;
}
// Appends to `links` a layer's attention (`attn`, where not null), o_proj (adds to x), and its MLP: a dense layer's
// gate_up (reads x through the post-attention norm) and down_proj (reads the SwiGLU of gate_up's output, adds to x),
// or a MoE layer's block as one link (`moe`: reads x through that norm, adds to x); weights all 8-bit (w8) or all in
// dt; then, where `next` >= 0 (the next layer's first id; its fused qkv of the same kind), its qkv projection of x
// through its input norm into c.qkv.
void mlp_chain(const TextConfig& tc, const DevParams& P, int f, int gate_up, bool w8, int next,
               const dev::ChainLink* attn, const dev::ChainMoe* moe, void* x, DevDecoderCtx& c, DType dt,
               std::vector<dev::ChainLink>& links) {
  const int64_t H = tc.hidden, Dq = tc.heads * tc.head_dim, Dk = tc.kv_heads * tc.head_dim;
  const float eps = float(tc.rms_eps);
  const auto link = [&](int id, const void* in, void* y, int64_t n_in, int64_t n_out, dev::RowsIn rin, bool add) {
    return dev::ChainLink{in, w8 ? P.q8[id] : P.p[id], w8 ? P.s8[id] : nullptr, y, n_in, n_out, rin, add};
  };
  if (attn) links.push_back(*attn);
  links.push_back(link(f + tlay::o_proj, c.att, x, Dq, H, {}, true));
  if (moe) {
    links.push_back({x, nullptr, nullptr, x, H, H, {nullptr, 1, false, c.ln2, P.p[f + tlay::post_norm], eps}, true});
    links.back().moe = moe;
  } else {
    // gate_up's SwiGLU computed by its tiles, which down_proj reads as is (dev::ChainLink::swiglu_pair), not by
    // down_proj's staging in each block: one 8B fp8 stream 3.75 against 3.89 ms a token on an H100
    // (docs/perf/2026-12-07-thirtyfifth/callF).
    const int64_t I = tc.intermediate;
    links.push_back(link(gate_up, x, c.gu, H, 2 * I, {nullptr, 1, false, c.ln2, P.p[f + tlay::post_norm], eps}, false));
    links.back().swiglu_pair = true;
    links.push_back(link(f + tlay::down_proj, c.gu, x, I, H, {nullptr, 1, true, c.act}, true));
  }
  if (next >= 0)
    links.push_back(link(fused_qkv(P, next, Dq, Dk, H, dt), x, c.qkv, H, Dq + 2 * Dk,
                         {nullptr, 1, false, c.ln1, P.p[next + tlay::in_norm], eps}, false));
}

// The links waiting in `a` (DevQkvAhead), launched as one chain.
void chain_flush(const dev::Exec& ex, DevQkvAhead& a, int64_t N, DType dt) {
  if (a.links.empty()) return;
  dev::linear_chain(ex, a.links.data(), int(a.links.size()), N, a.qf, dt);
  a.links.clear();
  a.attn.clear();
  a.moe.clear();
}
}  // namespace

bool& dev_chain_attn() {
  static bool on = !env_is("Q3VL_CHAIN_ATTN", "0");
  return on;
}
bool& dev_chain_moe() {
  static bool on = !env_is("Q3VL_CHAIN_MOE", "0");
  return on;
}

bool dev_decoder_infer(const dev::Exec& ex, const ModelConfig& cfg, const DevParams& P, int f, bool moe, void* x,
                       int64_t N, const DevPagedCache& kv, const float* cos, const float* sin, float* probs,
                       int32_t* idx, DevDecoderCtx& c, DevDecoderScratch& s, const DevPartialSum& reduce,
                       const void* pending, DevQkvAhead& ahead, DType dt) {
  const TextConfig& tc = cfg.text;
  const int64_t H = tc.hidden, nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim, Dq = nh * hd, Dk = nkv * hd;
  Q3VL_CHECK(!P.lora, "dev_decoder_infer: serving folds LoRA adapters into the weights first (lora_merge)");
  // The folds (dev_layers.hpp): decode-sized steps, the GEMV's rows, whose sums stay on this rank.
  static const bool fold_on = !env_is("Q3VL_DECODE_FOLD", "0");
  const bool fold = fold_on && N <= 16 && !reduce;
  const int qkv = fused_qkv(P, f, Dq, Dk, H, dt), gate_up = moe ? -1 : fused_gate_up(P, f, tc.intermediate, H, dt);
  const bool ready = std::exchange(ahead.ready, false);  // c.qkv written by the previous layer's chain
  Q3VL_CHECK(!ready || (fold && !pending), "dev_decoder_infer: a layer's qkv came ahead of its unfolded input norm");
  // A dense layer's attention, o_proj, gate_up and down_proj, all 8-bit (w8) or all in dt, as one chain (folded as
  // below, whatever the weights), and the next layer's qkv of the same kind: that layer then starts at its qkv rows.
  // A MoE layer's likewise, its MoE block one link (one row, weights in dt, no expert parallelism).
  const bool w8 = q8(P, f + tlay::o_proj);
  const QFormat cqf = w8 ? P.qf : QFormat::None;
  const int eg = moe ? dev_experts_id(P, f) : -1;
  const bool chain = chain_on() && fold &&
                     (moe ? dev_chain_moe() && N == 1 && !w8 && !c.ex && !c.el && !q8(P, f + tlay::router) &&
                                !q8(P, eg) && !q8(P, eg + 1)
                          : q8(P, gate_up) == w8 && q8(P, f + tlay::down_proj) == w8);
  if (!chain || !chain_attn_on() || ahead.qf != cqf) chain_flush(ex, ahead, N, dt);  // this layer's ops come after
  const bool norm_in = ready || (fold && !pending && q8(P, qkv)), add_o = fold && q8(P, f + tlay::o_proj);
  const bool norm_post = add_o && !moe && q8(P, gate_up);
  const bool add_down = fold && (moe ? !c.ex : q8(P, f + tlay::down_proj));
  const float eps = float(tc.rms_eps);
  if (!norm_in)
    dev::residual_rmsnorm_fwd(ex, pending, x, P.p[f + tlay::in_norm], c.ln1, nullptr, c.r1, N, H, tc.rms_eps, dt);
  // q_proj, k_proj and v_proj as one GEMM into [q | k | v] rows, then q and the new keys and values in one pass.
  if (!ready)
    dev_linear(ex, P, qkv, norm_in ? x : c.ln1, c.qkv, N, H, Dq + 2 * Dk, dt, 0,
               norm_in ? dev::RowsIn{nullptr, 1, false, c.ln1, P.p[f + tlay::in_norm], eps} : dev::RowsIn{});
  // The attention: the new keys and values into the cache, q and the paged attention into c.att (dev::ChainAttn).
  const dev::ChainAttn at{P.p[f + tlay::q_norm], P.p[f + tlay::k_norm], cos, sin, kv.k, kv.v, kv.slots, kv.cu,
                          kv.ctx, kv.table, kv.max_blocks, kv.block, kv.nseg, kv.max_q, kv.max_ctx, kv.keys, nh, nkv,
                          hd, tc.rms_eps, float(1 / std::sqrt(double(hd))), c.q};
  dev::ChainLink attn;
  attn.in = c.qkv, attn.y = c.att, attn.attn = &at;
  if (chain) {
    ahead.ready = ahead.next >= 0 && q8(P, fused_qkv(P, ahead.next, Dq, Dk, H, dt)) == w8;
    const dev::ChainLink* first = nullptr;  // the attention as the chain's first link, or its own ops before it
    if (chain_attn_on()) attn.attn = &ahead.attn.emplace_back(at), first = &attn;
    else dev::chain_attn_ops(ex, attn, N, dt);
    ahead.qf = cqf;
    const dev::ChainMoe* mo = nullptr;  // the MoE block's ops' arguments (mlp_fwd's)
    if (moe) mo = &ahead.moe.emplace_back(moe_args(tc, P, f, probs, idx, c, s));
    mlp_chain(tc, P, f, gate_up, w8, ahead.ready ? ahead.next : -1, first, mo, x, c, dt, ahead.links);
    // The next layer's links join these where they fit one kernel (Q3VL_CHAIN_LAYERS=1: a chain a layer): 5 jobs of
    // the kernel a dense layer, 3 + kChainMoeJobs a MoE layer's.
    const size_t jobs = ahead.links.size() + (dev::kChainMoeJobs - 1) * ahead.moe.size();
    if (!ahead.ready || !chain_layers_on() || jobs + 3 + dev::kChainMoeJobs > size_t(dev::kChainMaxLinks))
      chain_flush(ex, ahead, N, dt);
    return true;
  }
  // Its two ops: alone, the chain kernel's attention link lost to them (a MoE layer's, H100: one 30B-A3B stream 4.75
  // against 4.39 ms, docs/perf/2026-12-07-thirtyfourth/callA); inside a chain the link wins.
  dev::chain_attn_ops(ex, attn, N, dt);
  dev_linear(ex, P, f + tlay::o_proj, c.att, add_o ? x : s.tmp, N, Dq, H, dt, 0, {}, add_o);
  if (reduce) reduce(s.tmp, N * H);
  if (!norm_post)
    dev::residual_rmsnorm_fwd(ex, add_o ? nullptr : s.tmp, x, P.p[f + tlay::post_norm], c.ln2, nullptr, c.r2, N, H,
                              tc.rms_eps, dt);
  mlp_fwd(ex, tc, P, f, moe, N, probs, idx, c, s, dt, {norm_post ? x : nullptr, add_down ? x : nullptr});
  if (reduce) reduce(s.tmp, N * H);
  return add_down;
}

void dev_decoder_bwd(const dev::Exec& ex, const ModelConfig& cfg, const DevParams& P, int f, bool moe, void* dx,
                     int64_t N, const DevSegments& seg, const float* cos, const float* sin, const float* probs,
                     const int32_t* idx, const void* aux_dlogits, DevDecoderCtx& c, DevDecoderScratch& s, DType dt) {
  const TextConfig& tc = cfg.text;
  const int64_t H = tc.hidden, nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim, Dq = nh * hd, Dk = nkv * hd;
  // MLP / MoE branch. The first op to produce a gradient buffer writes it, the later ones add (dev.hpp).
  if (moe) {
    const int64_t E = tc.num_experts, k = tc.experts_per_tok, Im = tc.moe_intermediate, R = N * k;
    if (c.ex) {  // expert parallelism: the experts' part on their owners
      dev_moe_experts_bwd(ex, tc, P, f, dx, N, c, s, dt);
    } else {
      const int eg = dev_experts_id(P, f);
      dev::moe_combine_bwd(ex, dx, c.ey, c.pos, c.w, s.dw, s.dyg, N, k, H, false, dt);
      dev::swiglu_fwd(ex, c.egu, s.eact, R, Im, dt);  // recomputed, cheaper than keeping it
      const DevGradOut down = dev_grad_out(ex, P, eg + 1);
      dev::grouped_linear_bwd(ex, s.dyg, s.eact, P.p[eg + 1], c.start, s.edact, P.g[eg + 1], R, E, Im, H, false,
                              down.adds, dt, down.sq);
      dev::swiglu_bwd(ex, s.edact, c.egu, s.edgu, R, Im, false, dt);
      dev::gather_rows(ex, c.ln2, c.rows, k, s.xg, R, H, dt);
      const DevGradOut gu = dev_grad_out(ex, P, eg);
      dev::grouped_linear_bwd(ex, s.edgu, s.xg, P.p[eg], c.start, s.dxg, P.g[eg], R, E, H, 2 * Im, false, gu.adds,
                              dt, gu.sq);
    }
    dev::unpermute_add(ex, s.dxg, c.pos, s.dln, N, k, H, false, dt);
    // The logit gradients of the combine weights and of the aux loss summed in fp32, rounded once to dt for the
    // router's GEMMs (whose other operands are dt), into s.logits (fp32-sized, free after the forward).
    dev::router_bwd(ex, s.dw, probs, idx, s.dlogits, N, E, k, false, DType::F32);
    if (aux_dlogits) dev::axpy(ex, 1.f, aux_dlogits, s.dlogits, N * E, DType::F32);
    void* dl = s.dlogits;
    if (dt != DType::F32) dev::convert(ex, dl = s.logits, dt, s.dlogits, DType::F32, N * E);
    dev::linear_bwd(ex, dl, c.ln2, P.p[f + tlay::router], s.dln, P.g[f + tlay::router], nullptr, N, H, E, true,
                    dev_grad_adds(ex, P, {f + tlay::router}), dt);
    dev_lora_bwd(ex, P, f + tlay::router, dl, E, c.ln2, N, s.dln, dt);
  } else {
    const int64_t I = tc.intermediate;
    dev::linear_bwd(ex, dx, c.act, P.p[f + tlay::down_proj], s.dact, P.g[f + tlay::down_proj], nullptr, N, I, H,
                    false, dev_grad_adds(ex, P, {f + tlay::down_proj}), dt);
    dev_lora_bwd(ex, P, f + tlay::down_proj, dx, H, c.act, N, s.dact, dt);
    dev::swiglu_bwd(ex, s.dact, c.gu, s.dgu, N, I, false, dt);
    // The gate and up adapters add into s.dln before the fused linear does (lora.cpp's order).
    const bool lora = dev_lora_on(P, f + tlay::gate_proj) || dev_lora_on(P, f + tlay::up_proj);
    if (lora) zero(ex, s.dln, N * H, dt);
    dev_lora_bwd(ex, P, f + tlay::gate_proj, s.dgu, 2 * I, c.ln2, N, s.dln, dt);
    dev_lora_bwd(ex, P, f + tlay::up_proj, at(s.dgu, I, dt), 2 * I, c.ln2, N, s.dln, dt);
    dev::linear_bwd(ex, s.dgu, c.ln2, P.p[fused_gate_up(P, f, I, H, dt)], s.dln, P.g[f + tlay::gate_proj], nullptr, N,
                    H, 2 * I, lora, dev_grad_adds(ex, P, {f + tlay::gate_proj, f + tlay::up_proj}), dt);
  }
  dev_grad_zeroed(ex, P, f + tlay::post_norm);
  dev::rmsnorm_bwd(ex, s.dln, c.x1, P.p[f + tlay::post_norm], c.r2, dx, P.g[f + tlay::post_norm], N, H, true, dt);
  // Attention branch.
  dev::linear_bwd(ex, dx, c.att, P.p[f + tlay::o_proj], s.datt, P.g[f + tlay::o_proj], nullptr, N, Dq, H, false,
                  dev_grad_adds(ex, P, {f + tlay::o_proj}), dt);
  dev_lora_bwd(ex, P, f + tlay::o_proj, dx, H, c.att, N, s.datt, dt);
  dev::attention_bwd(ex, s.datt, c.q, c.k, c.v, c.att, c.lse, s.dq, s.dk, s.dv, seg.cu, seg.nseg, seg.max_len, N, nh,
                     nkv, hd, true, float(1 / std::sqrt(double(hd))), false, dt);
  // The fused projection's gradient rows s.dqkv = [d qraw | d kraw | dv], then one linear backward.
  const int64_t ld = Dq + 2 * Dk;
  dev_grad_zeroed(ex, P, f + tlay::q_norm);
  dev_grad_zeroed(ex, P, f + tlay::k_norm);
  dev::qk_norm_rope_bwd(ex, s.dq, s.dk, c.qkv, at(c.qkv, Dq, dt), P.p[f + tlay::q_norm], P.p[f + tlay::k_norm], c.rq,
                        c.rk, cos, sin, s.dqkv, at(s.dqkv, Dq, dt), P.g[f + tlay::q_norm], P.g[f + tlay::k_norm], N, nh,
                        nkv, hd, ld, false, dt);
  dev::copy_2d(ex, s.dv, Dk, at(s.dqkv, Dq + Dk, dt), ld, N, Dk, dt);
  // The adapters add into s.dln before the fused linear does (lora.cpp's order).
  const bool lora = dev_lora_on(P, f + tlay::q_proj) || dev_lora_on(P, f + tlay::k_proj) ||
                    dev_lora_on(P, f + tlay::v_proj);
  if (lora) zero(ex, s.dln, N * H, dt);
  dev_lora_bwd(ex, P, f + tlay::q_proj, s.dqkv, ld, c.ln1, N, s.dln, dt);
  dev_lora_bwd(ex, P, f + tlay::k_proj, at(s.dqkv, Dq, dt), ld, c.ln1, N, s.dln, dt);
  dev_lora_bwd(ex, P, f + tlay::v_proj, at(s.dqkv, Dq + Dk, dt), ld, c.ln1, N, s.dln, dt);
  dev::linear_bwd(ex, s.dqkv, c.ln1, P.p[fused_qkv(P, f, Dq, Dk, H, dt)], s.dln, P.g[f + tlay::q_proj], nullptr, N, H,
                  ld, lora, dev_grad_adds(ex, P, {f + tlay::q_proj, f + tlay::k_proj, f + tlay::v_proj}), dt);
  dev_grad_zeroed(ex, P, f + tlay::in_norm);
  dev::rmsnorm_bwd(ex, s.dln, c.x, P.p[f + tlay::in_norm], c.r1, dx, P.g[f + tlay::in_norm], N, H, true, dt);
}

}  // namespace q3vl
