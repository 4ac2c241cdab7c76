// MoE block (spec 4.8, 9): softmax router, top-k (ties to the lower index), renormalised weights, SwiGLU experts
// in the transformers-5 layout gate_up [E,2Im,H] (gate rows first), down [E,H,Im]. Tokens are gathered per expert
// so each expert runs two GEMMs on its rows only.
#include <algorithm>

#include "q3vl/model/layers.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

template <class T>
void moe_fwd(const TextConfig& tc, const ParamView<T>& P, int f, const T* x, int64_t N, T* out, T* probs,
             int64_t* idx, MoeCtx<T>& c) {
  const int64_t H = tc.hidden, E = tc.num_experts, k = tc.experts_per_tok, Im = tc.moe_intermediate, R = N * k;
  std::vector<T> logits(N * E);
  ops::linear_fwd(x, P.p[f + tlay::router], (const T*)nullptr, logits.data(), N, H, E);
  lora_fwd(P, f + tlay::router, x, N, logits.data(), E);
  c.w.resize(R);
  ops::router_fwd(logits.data(), probs, idx, c.w.data(), N, E, k);
  // Bucket (token, slot) pairs by expert, tokens in increasing order inside a bucket.
  c.start.assign(E + 1, 0);
  for (int64_t r = 0; r < R; ++r) c.start[idx[r] + 1]++;
  for (int64_t e = 0; e < E; ++e) c.start[e + 1] += c.start[e];
  c.rows.resize(R);
  std::vector<int64_t> fill(c.start.begin(), c.start.end() - 1);
  for (int64_t r = 0; r < R; ++r) c.rows[fill[idx[r]]++] = r;
  c.gu.resize(R * 2 * Im);
  c.y.resize(R * H);
  std::vector<T> xg(R * H), act(R * Im);
  for (int64_t j = 0; j < R; ++j) std::copy(x + (c.rows[j] / k) * H, x + (c.rows[j] / k + 1) * H, xg.data() + j * H);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = c.start[e], n = c.start[e + 1] - s;
    if (n == 0) continue;
    ops::linear_fwd(xg.data() + s * H, P.p[f + tlay::experts_gate_up] + e * 2 * Im * H, (const T*)nullptr,
                    c.gu.data() + s * 2 * Im, n, H, 2 * Im);
    ops::swiglu_fwd(c.gu.data() + s * 2 * Im, act.data() + s * Im, n, Im);
    ops::linear_fwd(act.data() + s * Im, P.p[f + tlay::experts_down] + e * H * Im, (const T*)nullptr,
                    c.y.data() + s * H, n, Im, H);
  }
  std::fill(out, out + N * H, T(0));
  for (int64_t j = 0; j < R; ++j) {
    const int64_t t = c.rows[j] / k;
    const T w = c.w[c.rows[j]];
    for (int64_t d = 0; d < H; ++d) out[t * H + d] += w * c.y[j * H + d];
  }
}

template <class T>
void moe_bwd(const TextConfig& tc, const ParamView<T>& P, int f, const T* dout, const T* x, int64_t N, T* dx,
             const T* probs, const int64_t* idx, const T* aux_dlogits, MoeCtx<T>& c) {
  const int64_t H = tc.hidden, E = tc.num_experts, k = tc.experts_per_tok, Im = tc.moe_intermediate, R = N * k;
  std::vector<T> dw(R), dyg(R * H), act(R * Im), xg(R * H);
  for (int64_t j = 0; j < R; ++j) {
    const int64_t t = c.rows[j] / k;
    const T w = c.w[c.rows[j]];
    T acc = 0;
    for (int64_t d = 0; d < H; ++d) {
      acc += dout[t * H + d] * c.y[j * H + d];
      dyg[j * H + d] = w * dout[t * H + d];
    }
    dw[c.rows[j]] = acc;
    std::copy(x + t * H, x + (t + 1) * H, xg.data() + j * H);
  }
  ops::swiglu_fwd(c.gu.data(), act.data(), R, Im);  // recomputed, cheaper than keeping it
  std::vector<T> dact, dgu, dxg;
  // Frozen experts (LoRA base): null gradients stay null per expert.
  T* const gdown = P.g[f + tlay::experts_down];
  T* const ggu = P.g[f + tlay::experts_gate_up];
  for (int64_t e = 0; e < E; ++e) {
    const int64_t s = c.start[e], n = c.start[e + 1] - s;
    if (n == 0) continue;
    dact.assign(n * Im, T(0));
    dgu.assign(n * 2 * Im, T(0));
    dxg.assign(n * H, T(0));
    ops::linear_bwd(dyg.data() + s * H, act.data() + s * Im, P.p[f + tlay::experts_down] + e * H * Im, dact.data(),
                    gdown ? gdown + e * H * Im : nullptr, (T*)nullptr, n, Im, H);
    ops::swiglu_bwd(dact.data(), c.gu.data() + s * 2 * Im, dgu.data(), n, Im);
    ops::linear_bwd(dgu.data(), xg.data() + s * H, P.p[f + tlay::experts_gate_up] + e * 2 * Im * H, dxg.data(),
                    ggu ? ggu + e * 2 * Im * H : nullptr, (T*)nullptr, n, H, 2 * Im);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = c.rows[s + j] / k;
      for (int64_t d = 0; d < H; ++d) dx[t * H + d] += dxg[j * H + d];
    }
  }
  std::vector<T> dlogits(N * E, T(0));
  ops::router_bwd(dw.data(), probs, idx, dlogits.data(), N, E, k);
  if (aux_dlogits)
    for (int64_t i = 0; i < N * E; ++i) dlogits[i] += aux_dlogits[i];
  ops::linear_bwd(dlogits.data(), x, P.p[f + tlay::router], dx, P.g[f + tlay::router], (T*)nullptr, N, H, E);
  lora_bwd(P, f + tlay::router, dlogits.data(), E, x, N, dx);
}

#define Q3VL_INST(T)                                                                                               \
  template void moe_fwd<T>(const TextConfig&, const ParamView<T>&, int, const T*, int64_t, T*, T*, int64_t*,      \
                           MoeCtx<T>&);                                                                           \
  template void moe_bwd<T>(const TextConfig&, const ParamView<T>&, int, const T*, const T*, int64_t, T*,          \
                           const T*, const int64_t*, const T*, MoeCtx<T>&);
Q3VL_INST(float)
Q3VL_INST(double)
#undef Q3VL_INST

}  // namespace q3vl
