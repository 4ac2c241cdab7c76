// Text decoder layer (spec 4.3, 4.4, 4.7): RMSNorm -> GQA attention with per-head QK RMSNorm and interleaved
// M-RoPE -> residual; RMSNorm -> dense SwiGLU MLP or MoE block -> residual.
#include <algorithm>
#include <cmath>
#include <limits>

#include "q3vl/core/error.hpp"
#include "layers.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

template <class T>
void param_linear(const ParamView<T>& P, int id, int64_t row0, const T* x, T* y, int64_t N, int64_t in, int64_t out) {
  if (const LowWeight* w = P.lowp(id)) {
    const LowWeight r = w->from_row(row0, in);
    r.visit([&](const auto* rows) { ops::linear_lowp_fwd(x, rows, r.scale, (const T*)nullptr, y, N, in, out); });
  } else
    ops::linear_fwd(x, P.p[id] + row0 * in, (const T*)nullptr, y, N, in, out);
}

// Dense MLP runs gate and up as one [2I, H] matrix: the table keeps gate_proj and up_proj adjacent (their
// low-precision copies too, BasicModel::lower_weights).
template <class T>
static const T* fused_gate_up(const ParamView<T>& P, int f, int64_t I, int64_t H) {
  if (const LowWeight* g = P.lowp(f + tlay::gate_proj)) {
    const LowWeight* u = P.lowp(f + tlay::up_proj);
    Q3VL_CHECK(u && u->w == g->from_row(I, H).w && u->scale == g->from_row(I, H).scale,
               "low-precision gate_proj/up_proj must be adjacent");
    return nullptr;
  }
  Q3VL_CHECK(P.p[f + tlay::up_proj] == P.p[f + tlay::gate_proj] + I * H, "gate_proj/up_proj must be adjacent");
  // Null grads: bound for forward only (ZeRO-3).
  Q3VL_CHECK(!P.g[f + tlay::gate_proj] || P.g[f + tlay::up_proj] == P.g[f + tlay::gate_proj] + I * H,
             "gate_proj/up_proj grads must be adjacent");
  return P.p[f + tlay::gate_proj];
}

// in_norm -> q, k, v projections -> QK-norm -> RoPE, into c (training and inference share it).
template <class T>
static void qkv_fwd(const TextConfig& tc, const ParamView<T>& P, int f, const T* x, int64_t N, const T* cos,
                    const T* sin, DecoderCtx<T>& c) {
  const int64_t H = tc.hidden, nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim, Dq = nh * hd, Dk = nkv * hd;
  c.ln1.resize(N * H);
  c.r1.resize(N);
  c.qraw.resize(N * Dq);
  c.kraw.resize(N * Dk);
  c.q.resize(N * Dq);
  c.k.resize(N * Dk);
  c.v.resize(N * Dk);
  c.rq.resize(N * nh);
  c.rk.resize(N * nkv);
  ops::rmsnorm_fwd(x, P.p[f + tlay::in_norm], c.ln1.data(), c.r1.data(), N, H, tc.rms_eps);
  param_linear(P, f + tlay::q_proj, 0, c.ln1.data(), c.qraw.data(), N, H, Dq);
  param_linear(P, f + tlay::k_proj, 0, c.ln1.data(), c.kraw.data(), N, H, Dk);
  param_linear(P, f + tlay::v_proj, 0, c.ln1.data(), c.v.data(), N, H, Dk);
  lora_fwd(P, f + tlay::q_proj, c.ln1.data(), N, c.qraw.data(), Dq);
  lora_fwd(P, f + tlay::k_proj, c.ln1.data(), N, c.kraw.data(), Dk);
  lora_fwd(P, f + tlay::v_proj, c.ln1.data(), N, c.v.data(), Dk);
  ops::rmsnorm_fwd(c.qraw.data(), P.p[f + tlay::q_norm], c.q.data(), c.rq.data(), N * nh, hd, tc.rms_eps);
  ops::rmsnorm_fwd(c.kraw.data(), P.p[f + tlay::k_norm], c.k.data(), c.rk.data(), N * nkv, hd, tc.rms_eps);
  ops::rope_fwd(c.q.data(), cos, sin, N, nh, hd);
  ops::rope_fwd(c.k.data(), cos, sin, N, nkv, hd);
}

// x += o_proj(c.att); then post_norm -> dense MLP or MoE -> residual.
template <class T>
static void out_mlp_fwd(const TextConfig& tc, const ParamView<T>& P, int f, bool moe, T* x, int64_t N, T* probs,
                        int64_t* idx, DecoderCtx<T>& c, const PartialSum<T>& reduce = {}) {
  const int64_t H = tc.hidden, Dq = (int64_t)tc.heads * tc.head_dim;
  // Tensor parallelism (serve) runs merged weights: an adapter's A and B would need the base's split, and a
  // replicated term would be summed once per rank (serve folds adapters in before it shards, server.cpp).
  Q3VL_CHECK(!(reduce && P.lora), "LoRA adapters under tensor parallelism: merge them into the base first");
  c.ln2.resize(N * H);
  c.r2.resize(N);
  std::vector<T> tmp(N * H);
  param_linear(P, f + tlay::o_proj, 0, c.att.data(), tmp.data(), N, Dq, H);
  lora_fwd(P, f + tlay::o_proj, c.att.data(), N, tmp.data(), H);
  if (reduce) reduce(tmp.data(), N * H);  // the partial sums, LoRA term included
  for (int64_t i = 0; i < N * H; ++i) x[i] += tmp[i];
  c.x1.assign(x, x + N * H);
  ops::rmsnorm_fwd(x, P.p[f + tlay::post_norm], c.ln2.data(), c.r2.data(), N, H, tc.rms_eps);
  if (moe) {
    moe_fwd(tc, P, f, c.ln2.data(), N, tmp.data(), probs, idx, c.moe);
  } else {
    const int64_t I = tc.intermediate;
    c.gu.resize(N * 2 * I);
    c.act.resize(N * I);
    fused_gate_up(P, f, I, H);
    param_linear(P, f + tlay::gate_proj, 0, c.ln2.data(), c.gu.data(), N, H, 2 * I);  // [gate; up] in one
    lora_fwd(P, f + tlay::gate_proj, c.ln2.data(), N, c.gu.data(), 2 * I);  // gate: columns [0, I) of gu
    lora_fwd(P, f + tlay::up_proj, c.ln2.data(), N, c.gu.data() + I, 2 * I);
    ops::swiglu_fwd(c.gu.data(), c.act.data(), N, I);
    param_linear(P, f + tlay::down_proj, 0, c.act.data(), tmp.data(), N, I, H);
    lora_fwd(P, f + tlay::down_proj, c.act.data(), N, tmp.data(), H);
  }
  if (reduce) reduce(tmp.data(), N * H);
  for (int64_t i = 0; i < N * H; ++i) x[i] += tmp[i];
}

template <class T>
void decoder_layer_fwd(const ModelConfig& cfg, const ParamView<T>& P, int f, bool moe, T* x, int64_t N,
                       const std::vector<int64_t>& cu, const T* cos, const T* sin, T* probs, int64_t* idx,
                       DecoderCtx<T>& c) {
  const TextConfig& tc = cfg.text;
  const int64_t nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim;
  c.x.assign(x, x + N * tc.hidden);
  qkv_fwd(tc, P, f, x, N, cos, sin, c);
  c.att.resize(N * nh * hd);
  c.lse.resize(N * nh);
  ops::attention_fwd(c.q.data(), c.k.data(), c.v.data(), c.att.data(), c.lse.data(), cu.data(),
                     (int64_t)cu.size() - 1, nh, nkv, hd, true, T(1 / std::sqrt((double)hd)));
  out_mlp_fwd(tc, P, f, moe, x, N, probs, idx, c);
}

template <class T>
void decoder_layer_infer(const ModelConfig& cfg, const ParamView<T>& P, int f, bool moe, T* x, int64_t N,
                         const std::vector<int64_t>& cu, const std::vector<int>& seqs, const T* cos, const T* sin,
                         HostKvCache<T>& cache, int layer, const PartialSum<T>& reduce) {
  const TextConfig& tc = cfg.text;
  const int64_t nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim, Dq = nh * hd, Dk = nkv * hd, grp = nh / nkv;
  const T scale = T(1 / std::sqrt((double)hd));
  DecoderCtx<T> c;
  qkv_fwd(tc, P, f, x, N, cos, sin, c);
  c.att.resize(N * Dq);
  std::vector<T> w;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int sq = seqs[s];
    const int64_t L0 = cache.len[sq];  // extend() adds the new tokens to len after the last layer
    for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
      std::copy(&c.k[i * Dk], &c.k[(i + 1) * Dk], cache.key(layer, sq, L0 + i - cu[s]));
      std::copy(&c.v[i * Dk], &c.v[(i + 1) * Dk], cache.val(layer, sq, L0 + i - cu[s]));
    }
    // One query at a time against all keys up to its own position: exact softmax, no blocking needed.
    for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
      const int64_t keys = L0 + (i - cu[s]) + 1;
      w.resize(keys);
      for (int64_t h = 0; h < nh; ++h) {
        const T* q = c.q.data() + i * Dq + h * hd;
        const int64_t ko = (h / grp) * hd;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < keys; ++j) {
          const T* K = cache.key(layer, sq, j) + ko;
          T dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += q[d] * K[d];
          w[j] = dot * scale;
          mx = std::max(mx, w[j]);
        }
        T sum = 0;
        for (int64_t j = 0; j < keys; ++j) sum += (w[j] = std::exp(w[j] - mx));
        T* o = c.att.data() + i * Dq + h * hd;
        std::fill(o, o + hd, T(0));
        for (int64_t j = 0; j < keys; ++j) {
          const T* V = cache.val(layer, sq, j) + ko;
          for (int64_t d = 0; d < hd; ++d) o[d] += w[j] * V[d];
        }
        for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
      }
    }
  }
  std::vector<T> probs(moe ? N * tc.num_experts : 0);
  std::vector<int64_t> idx(moe ? N * tc.experts_per_tok : 0);
  out_mlp_fwd(tc, P, f, moe, x, N, probs.data(), idx.data(), c, reduce);
}

template <class T>
void decoder_layer_bwd(const ModelConfig& cfg, const ParamView<T>& P, int f, bool moe, T* dx, int64_t N,
                       const std::vector<int64_t>& cu, const T* cos, const T* sin, const T* probs, const int64_t* idx,
                       const T* aux_dlogits, DecoderCtx<T>& c) {
  const TextConfig& tc = cfg.text;
  const int64_t H = tc.hidden, nh = tc.heads, nkv = tc.kv_heads, hd = tc.head_dim, Dq = nh * hd, Dk = nkv * hd;
  T* const nul = nullptr;
  // MLP / MoE branch.
  std::vector<T> dln(N * H);
  if (moe) {
    moe_bwd(tc, P, f, dx, c.ln2.data(), N, dln.data(), probs, idx, aux_dlogits, c.moe);
  } else {
    const int64_t I = tc.intermediate;
    std::vector<T> dact(N * I), dgu(N * 2 * I);
    ops::linear_bwd(dx, c.act.data(), P.p[f + tlay::down_proj], dact.data(), P.g[f + tlay::down_proj], nul, N, I, H);
    lora_bwd(P, f + tlay::down_proj, dx, H, c.act.data(), N, dact.data());
    ops::swiglu_bwd(dact.data(), c.gu.data(), dgu.data(), N, I);
    lora_bwd(P, f + tlay::gate_proj, dgu.data(), 2 * I, c.ln2.data(), N, dln.data());
    lora_bwd(P, f + tlay::up_proj, dgu.data() + I, 2 * I, c.ln2.data(), N, dln.data());
    ops::linear_bwd(dgu.data(), c.ln2.data(), fused_gate_up(P, f, I, H), dln.data(), P.g[f + tlay::gate_proj], nul, N,
                    H, 2 * I);
  }
  ops::rmsnorm_bwd(dln.data(), c.x1.data(), P.p[f + tlay::post_norm], c.r2.data(), dx, P.g[f + tlay::post_norm], N, H);
  // Attention branch.
  std::vector<T> datt(N * Dq), dq(N * Dq), dk(N * Dk), dv(N * Dk), dqr(N * Dq), dkr(N * Dk);
  ops::linear_bwd(dx, c.att.data(), P.p[f + tlay::o_proj], datt.data(), P.g[f + tlay::o_proj], nul, N, Dq, H);
  lora_bwd(P, f + tlay::o_proj, dx, H, c.att.data(), N, datt.data());
  ops::attention_bwd(datt.data(), c.q.data(), c.k.data(), c.v.data(), c.att.data(), c.lse.data(), dq.data(),
                     dk.data(), dv.data(), cu.data(), (int64_t)cu.size() - 1, nh, nkv, hd, true,
                     T(1 / std::sqrt((double)hd)));
  ops::rope_bwd(dq.data(), cos, sin, N, nh, hd);
  ops::rope_bwd(dk.data(), cos, sin, N, nkv, hd);
  ops::rmsnorm_bwd(dq.data(), c.qraw.data(), P.p[f + tlay::q_norm], c.rq.data(), dqr.data(), P.g[f + tlay::q_norm],
                   N * nh, hd);
  ops::rmsnorm_bwd(dk.data(), c.kraw.data(), P.p[f + tlay::k_norm], c.rk.data(), dkr.data(), P.g[f + tlay::k_norm],
                   N * nkv, hd);
  std::fill(dln.begin(), dln.end(), T(0));
  ops::linear_bwd(dqr.data(), c.ln1.data(), P.p[f + tlay::q_proj], dln.data(), P.g[f + tlay::q_proj], nul, N, H, Dq);
  ops::linear_bwd(dkr.data(), c.ln1.data(), P.p[f + tlay::k_proj], dln.data(), P.g[f + tlay::k_proj], nul, N, H, Dk);
  ops::linear_bwd(dv.data(), c.ln1.data(), P.p[f + tlay::v_proj], dln.data(), P.g[f + tlay::v_proj], nul, N, H, Dk);
  lora_bwd(P, f + tlay::q_proj, dqr.data(), Dq, c.ln1.data(), N, dln.data());
  lora_bwd(P, f + tlay::k_proj, dkr.data(), Dk, c.ln1.data(), N, dln.data());
  lora_bwd(P, f + tlay::v_proj, dv.data(), Dk, c.ln1.data(), N, dln.data());
  ops::rmsnorm_bwd(dln.data(), c.x.data(), P.p[f + tlay::in_norm], c.r1.data(), dx, P.g[f + tlay::in_norm], N, H);
}

#undef Q3VL_INST

#define Q3VL_INST(T)                                                                                               \
  template void param_linear<T>(const ParamView<T>&, int, int64_t, const T*, T*, int64_t, int64_t, int64_t);       \
  template void decoder_layer_fwd<T>(const ModelConfig&, const ParamView<T>&, int, bool, T*, int64_t,             \
                                     const std::vector<int64_t>&, const T*, const T*, T*, int64_t*,               \
                                     DecoderCtx<T>&);                                                             \
  template void decoder_layer_infer<T>(const ModelConfig&, const ParamView<T>&, int, bool, T*, int64_t,           \
                                       const std::vector<int64_t>&, const std::vector<int>&, const T*, const T*,  \
                                       HostKvCache<T>&, int, const PartialSum<T>&);                                   \
  template void decoder_layer_bwd<T>(const ModelConfig&, const ParamView<T>&, int, bool, T*, int64_t,             \
                                     const std::vector<int64_t>&, const T*, const T*, const T*, const int64_t*,   \
                                     const T*, DecoderCtx<T>&);
Q3VL_INST(float)
Q3VL_INST(double)

}  // namespace q3vl
