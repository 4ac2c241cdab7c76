// MoE block (spec 4.8, 9): softmax router, top-k (ties to the lower index), renormalised weights, SwiGLU experts
// in the transformers-5 layout gate_up [E,2Im,H] (gate rows first), down [E,H,Im]. Tokens are gathered per expert
// so each expert runs two GEMMs on its rows only.
//
// Expert parallelism (DESIGN.md): the gathered rows, expert-major, go by all-to-all to the ranks owning their
// experts (rank p owns experts [p*El, (p+1)*El)), which run them and send the outputs back (dispatch, combine);
// backward sends the output gradients the same way and the input gradients back. Dropless, and every token's
// arithmetic is the one it gets without expert parallelism: only rows of other ranks join an expert's GEMM.
#include <algorithm>

#include "q3vl/core/error.hpp"
#include "layers.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

namespace {

template <class T> constexpr DType dtype_of() { return sizeof(T) == 4 ? DType::F32 : DType::F64; }

// Rows through the exchange, or copied when every expert is local.
template <class T>
void exchange(ExpertExchange* ex, const std::vector<T>& send, const std::vector<int64_t>& send_rows,
              std::vector<T>& recv, const std::vector<int64_t>& recv_rows, int64_t width) {
  int64_t n = 0;
  for (int64_t r : recv_rows) n += r;
  recv.resize(size_t(n * width));
  if (!ex) return std::copy(send.begin(), send.begin() + n * width, recv.begin()), void();
  ex->rows(send.data(), send_rows, recv.data(), recv_rows, width, dtype_of<T>());
}

// Arrival order (rank-major) <-> expert-major on the owner, row by row.
template <class T>
void to_expert_major(const MoeCtx<T>& c, const std::vector<T>& arrived, std::vector<T>& out, int64_t width) {
  out.resize(c.perm.size() * width);
  for (size_t i = 0; i < c.perm.size(); ++i)
    std::copy(&arrived[c.perm[i] * width], &arrived[(c.perm[i] + 1) * width], &out[i * width]);
}
template <class T>
void to_arrival(const MoeCtx<T>& c, const T* rows, std::vector<T>& out, int64_t width) {
  out.resize(c.perm.size() * width);
  for (size_t i = 0; i < c.perm.size(); ++i)
    std::copy(rows + i * width, rows + (i + 1) * width, &out[c.perm[i] * width]);
}

}  // namespace

// The experts' first id (gate_up; down follows): f + experts_gate_up, unless LoRA put the layer unit's adapters
// between the router and the experts' own unit (they go at the end of the unit they wrap); the table knows.
template <class T>
static int experts_id(const ParamView<T>& P, int f) {
  if (!P.lora || !P.lora->table) return f + tlay::experts_gate_up;
  const ParamTable& t = *P.lora->table;
  for (int l = 0; l < t.config().text.layers; ++l)
    if (t.layer(l) == f) return t.experts(l);
  fail("moe: parameter " + std::to_string(f) + " starts no decoder layer");
}

template <class T>
void moe_fwd(const TextConfig& tc, const ParamView<T>& P, int f, const T* x, int64_t N, T* out, T* probs,
             int64_t* idx, MoeCtx<T>& c) {
  const int64_t H = tc.hidden, E = tc.num_experts, k = tc.experts_per_tok, Im = tc.moe_intermediate, R = N * k;
  const int G = c.ex ? c.ex->size() : 1;
  const int64_t El = E / G;
  const int eg = experts_id(P, f);
  std::vector<T> logits(N * E);
  if (N > 0) {
    ops::linear_fwd(x, P.p[f + tlay::router], (const T*)nullptr, logits.data(), N, H, E);
    lora_fwd(P, f + tlay::router, x, N, logits.data(), E);
  }
  c.w.resize(R);
  ops::router_fwd(logits.data(), probs, idx, c.w.data(), N, E, k);
  // Bucket (token, slot) pairs by expert, tokens in increasing order inside a bucket.
  c.start.assign(E + 1, 0);
  for (int64_t r = 0; r < R; ++r) c.start[idx[r] + 1]++;
  for (int64_t e = 0; e < E; ++e) c.start[e + 1] += c.start[e];
  c.rows.resize(R);
  std::vector<int64_t> fill(c.start.begin(), c.start.end() - 1);
  for (int64_t r = 0; r < R; ++r) c.rows[fill[idx[r]]++] = r;
  std::vector<T> xg(R * H);
  for (int64_t j = 0; j < R; ++j) std::copy(x + (c.rows[j] / k) * H, x + (c.rows[j] / k + 1) * H, xg.data() + j * H);

  // Dispatch: each owner learns how many rows of each of its experts every rank sends, then gets the rows.
  std::vector<int64_t> cnt_send(E), cnt_recv(E);
  for (int64_t e = 0; e < E; ++e) cnt_send[e] = c.start[e + 1] - c.start[e];
  if (c.ex) c.ex->counts(cnt_send.data(), cnt_recv.data(), El);
  else cnt_recv = cnt_send;
  c.send_rows.assign(G, 0);
  c.recv_rows.assign(G, 0);
  for (int p = 0; p < G; ++p)
    for (int64_t j = 0; j < El; ++j) c.send_rows[p] += cnt_send[p * El + j], c.recv_rows[p] += cnt_recv[p * El + j];
  std::vector<T> arrived;
  exchange(c.ex, xg, c.send_rows, arrived, c.recv_rows, H);
  // Expert-major order of the arrived rows: expert j's rows from rank 0, then rank 1, ...
  std::vector<int64_t> at(G * El);  // arrival row of (rank p, expert j)'s first row
  for (int64_t i = 0, s = 0; i < G * El; ++i) at[i] = s, s += cnt_recv[i];
  c.ostart.assign(El + 1, 0);
  c.perm.clear();
  c.src.clear();
  for (int64_t j = 0; j < El; ++j) {
    for (int p = 0; p < G; ++p)
      for (int64_t i = 0; i < cnt_recv[p * El + j]; ++i) c.perm.push_back(at[p * El + j] + i), c.src.push_back(p);
    c.ostart[j + 1] = int64_t(c.perm.size());
  }
  if (c.ex && !c.recomputed) c.ex->note_received(int64_t(c.perm.size()));
  to_expert_major(c, arrived, c.xo, H);

  const int64_t Ro = int64_t(c.perm.size());
  c.gu.resize(Ro * 2 * Im);
  std::vector<T> act(Ro * Im), yo(Ro * H);
  for (int64_t e = 0; e < El; ++e) {
    const int64_t s = c.ostart[e], n = c.ostart[e + 1] - s;
    if (n == 0) continue;
    param_linear(P, eg, e * 2 * Im, c.xo.data() + s * H, c.gu.data() + s * 2 * Im, n, H, 2 * Im);
    ops::swiglu_fwd(c.gu.data() + s * 2 * Im, act.data() + s * Im, n, Im);
    param_linear(P, eg + 1, e * H, act.data() + s * Im, yo.data() + s * H, n, Im, H);
  }
  if (!c.ex) std::vector<T>().swap(c.xo);  // all local: backward regathers the rows from x, not kept twice
  // Combine: the outputs go back to the ranks their tokens came from, in the order they were sent.
  std::vector<T> back;
  to_arrival(c, yo.data(), back, H);
  exchange(c.ex, back, c.recv_rows, c.y, c.send_rows, H);
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
  const int G = c.ex ? c.ex->size() : 1;
  const int64_t El = E / G;
  const int eg = experts_id(P, f);
  std::vector<T> dw(R), dyg(R * H);
  for (int64_t j = 0; j < R; ++j) {
    const int64_t t = c.rows[j] / k;
    const T w = c.w[c.rows[j]];
    T acc = 0;
    for (int64_t d = 0; d < H; ++d) {
      acc += dout[t * H + d] * c.y[j * H + d];
      dyg[j * H + d] = w * dout[t * H + d];
    }
    dw[c.rows[j]] = acc;
  }
  // Output gradients to the owners (the dispatch's route), input gradients back (the combine's).
  std::vector<T> arrived, dyo;
  exchange(c.ex, dyg, c.send_rows, arrived, c.recv_rows, H);
  to_expert_major(c, arrived, dyo, H);
  const int64_t Ro = int64_t(c.perm.size());
  if (!c.ex) {
    c.xo.resize(Ro * H);
    for (int64_t j = 0; j < R; ++j) std::copy(x + (c.rows[j] / k) * H, x + (c.rows[j] / k + 1) * H, &c.xo[j * H]);
  }
  std::vector<T> act(Ro * Im), dxo(Ro * H, T(0));
  ops::swiglu_fwd(c.gu.data(), act.data(), Ro, Im);  // recomputed, cheaper than keeping it
  // Frozen experts (LoRA base): null gradients stay null per expert.
  T* const gdown = P.g[eg + 1];
  T* const ggu = P.g[eg];
  // Weight gradients of rows from other ranks carry their rank's micro-step scale: scaled copies of the inputs
  // (the input gradients do not depend on them; frozen experts need none).
  std::vector<T> xs, as;
  const bool scaled = c.ex != nullptr && (gdown || ggu);
  if (scaled) {
    const std::vector<double>& sc = c.ex->scales();
    xs = c.xo, as = act;
    for (int64_t i = 0; i < Ro; ++i) {
      const T s = T(sc[size_t(c.src[i])]);
      for (int64_t d = 0; d < H; ++d) xs[i * H + d] *= s;
      for (int64_t d = 0; d < Im; ++d) as[i * Im + d] *= s;
    }
  }
  const T* xin = scaled ? xs.data() : c.xo.data();
  const T* ain = scaled ? as.data() : act.data();
  std::vector<T> dact, dgu;
  for (int64_t e = 0; e < El; ++e) {
    const int64_t s = c.ostart[e], n = c.ostart[e + 1] - s;
    if (n == 0) continue;
    dact.assign(n * Im, T(0));
    dgu.assign(n * 2 * Im, T(0));
    ops::linear_bwd(dyo.data() + s * H, ain + s * Im, P.p[eg + 1] + e * H * Im, dact.data(),
                    gdown ? gdown + e * H * Im : nullptr, (T*)nullptr, n, Im, H);
    ops::swiglu_bwd(dact.data(), c.gu.data() + s * 2 * Im, dgu.data(), n, Im);
    ops::linear_bwd(dgu.data(), xin + s * H, P.p[eg] + e * 2 * Im * H, dxo.data() + s * H,
                    ggu ? ggu + e * 2 * Im * H : nullptr, (T*)nullptr, n, H, 2 * Im);
  }
  std::vector<T> back, dxg;
  to_arrival(c, dxo.data(), back, H);
  exchange(c.ex, back, c.recv_rows, dxg, c.send_rows, H);
  for (int64_t j = 0; j < R; ++j) {
    const int64_t t = c.rows[j] / k;
    for (int64_t d = 0; d < H; ++d) dx[t * H + d] += dxg[j * H + d];
  }
  std::vector<T> dlogits(N * E, T(0));
  ops::router_bwd(dw.data(), probs, idx, dlogits.data(), N, E, k);
  if (aux_dlogits)
    for (int64_t i = 0; i < N * E; ++i) dlogits[i] += aux_dlogits[i];
  if (N > 0) {
    ops::linear_bwd(dlogits.data(), x, P.p[f + tlay::router], dx, P.g[f + tlay::router], (T*)nullptr, N, H, E);
    lora_bwd(P, f + tlay::router, dlogits.data(), E, x, N, dx);
  }
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
