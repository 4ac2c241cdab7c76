// LM head + causal-LM cross-entropy (spec 4.9, 5.1), chunked over rows: only a chunk of logits exists at a time
// and the backward recomputes them instead of keeping [N, V]. Rows without a target skip the head (in training most
// rows are prompt or image tokens) unless the caller wants every row's logits. A LoRA adapter on the head (module
// lm_head) adds its rank-r GEMMs per chunk, its gradients beside the head's.
#include <algorithm>
#include <cmath>
#include <vector>

#include "layers.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

static constexpr int64_t kHeadChunk = 128;

// Rows that have a target: the others contribute nothing to the loss or its gradient.
static std::vector<int64_t> supervised_rows(const int64_t* target, int64_t N) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < N; ++i)
    if (target[i] != -100) rows.push_back(i);
  return rows;
}

// Copies rows[r0, r0+n) of h and target into contiguous buffers.
template <class T>
static void gather_rows(const T* h, const int64_t* target, const std::vector<int64_t>& rows, int64_t r0, int64_t n,
                        int64_t H, T* hb, int64_t* tb) {
  for (int64_t r = 0; r < n; ++r) {
    std::copy(h + rows[r0 + r] * H, h + (rows[r0 + r] + 1) * H, hb + r * H);
    tb[r] = target[rows[r0 + r]];
  }
}

// The [chunk, V] logits buffer, kept between calls: with a large vocabulary a fresh zeroed one per call costs more
// (page faults, memset) than the head's GEMM on small models.
template <class T>
static T* scratch(int64_t n) {
  thread_local std::vector<T> buf;
  if ((int64_t)buf.size() < n) buf.resize(n);
  return buf.data();
}

// z <- scale * (softmax(z) - onehot(target)) row by row, in place: one exp per logit and no second [n, V] buffer.
// The targets were range-checked by the forward's cross_entropy.
template <class T>
static void softmax_grad_inplace(T* z, const int64_t* target, int64_t n, int64_t V, T scale) {
  for (int64_t r = 0; r < n; ++r) {
    T* x = z + r * V;
    const T mx = *std::max_element(x, x + V);
    T sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += (x[j] = std::exp(x[j] - mx));
    const T c = scale / sum;
    for (int64_t j = 0; j < V; ++j) x[j] *= c;
    x[target[r]] -= scale;
  }
}

// logits of n rows: h W^T (+ scale (h A^T) B^T); row0: the rows' first index among the head's input rows (their
// place in the adapter's dropout mask, the same in forward and backward).
template <class T>
static void head_fwd(const ParamView<T>& P, int head, const T* h, T* lg, int64_t n, int64_t H, int64_t V,
                     int64_t row0) {
  if (const LowWeight* w = P.lowp(head))
    w->visit([&](const auto* rows) { ops::linear_lowp_fwd(h, rows, w->scale, (const T*)nullptr, lg, n, H, V); });
  else ops::linear_fwd(h, P.p[head], (const T*)nullptr, lg, n, H, V);
  lora_fwd(P, head, h, n, lg, V, 0, -1, row0);
}

template <class T>
double lm_head_loss_fwd(const ParamView<T>& P, int head, const T* h, const int64_t* target, int64_t N, int64_t H,
                        int64_t V, T* logits_out) {
  double total = 0;
  if (logits_out) {
    for (int64_t i0 = 0; i0 < N; i0 += kHeadChunk) {
      const int64_t n = std::min(kHeadChunk, N - i0);
      head_fwd(P, head, h + i0 * H, logits_out + i0 * V, n, H, V, i0);
      total += ops::cross_entropy(logits_out + i0 * V, target + i0, (T*)nullptr, (T*)nullptr, n, V, T(0));
    }
    return total;
  }
  const std::vector<int64_t> rows = supervised_rows(target, N);
  const int64_t R = (int64_t)rows.size(), C = std::min(R, kHeadChunk);
  std::vector<T> hb(C * H);
  std::vector<int64_t> tb(C);
  T* lg = scratch<T>(C * V);
  for (int64_t r0 = 0; r0 < R; r0 += kHeadChunk) {
    const int64_t n = std::min(kHeadChunk, R - r0);
    gather_rows(h, target, rows, r0, n, H, hb.data(), tb.data());
    head_fwd(P, head, hb.data(), lg, n, H, V, r0);
    total += ops::cross_entropy(lg, tb.data(), (T*)nullptr, (T*)nullptr, n, V, T(0));
  }
  return total;
}

template <class T>
void lm_head_loss_bwd(const ParamView<T>& P, int head, const T* h, const int64_t* target, int64_t N, int64_t H,
                      int64_t V, T scale, T* dh) {
  const std::vector<int64_t> rows = supervised_rows(target, N);
  const int64_t R = (int64_t)rows.size(), C = std::min(R, kHeadChunk);
  std::vector<T> hb(C * H), dhb(C * H);
  std::vector<int64_t> tb(C);
  T* lg = scratch<T>(C * V);
  for (int64_t r0 = 0; r0 < R; r0 += kHeadChunk) {
    const int64_t n = std::min(kHeadChunk, R - r0);
    gather_rows(h, target, rows, r0, n, H, hb.data(), tb.data());
    head_fwd(P, head, hb.data(), lg, n, H, V, r0);
    softmax_grad_inplace(lg, tb.data(), n, V, scale);
    std::fill(dhb.begin(), dhb.begin() + n * H, T(0));
    ops::linear_bwd(lg, hb.data(), P.p[head], dhb.data(), P.g[head], (T*)nullptr, n, H, V);
    lora_bwd(P, head, lg, V, hb.data(), n, dhb.data(), 0, -1, r0);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d < H; ++d) dh[rows[r0 + r] * H + d] += dhb[r * H + d];
  }
}

#define Q3VL_INST(T)                                                                                            \
  template double lm_head_loss_fwd<T>(const ParamView<T>&, int, const T*, const int64_t*, int64_t, int64_t,     \
                                      int64_t, T*);                                                           \
  template void lm_head_loss_bwd<T>(const ParamView<T>&, int, const T*, const int64_t*, int64_t, int64_t,       \
                                    int64_t, T, T*);
Q3VL_INST(float)
Q3VL_INST(double)
#undef Q3VL_INST

}  // namespace q3vl
