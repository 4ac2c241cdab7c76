// LoRA's forward and backward on the host layers (layers.hpp: lora_fwd, lora_bwd), as PEFT computes them.
#include <vector>

#include "layers.hpp"
#include "q3vl/core/hash.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

// dropout(x) of one call: element (row0 + row, col) keeps or drops as dropout_drops(key, (row0 + row) * in + col)
// says, so backward redraws the forward's mask, and the device model (dev::dropout_fwd) draws the same one.
template <class T>
static const T* dropped(const LoraRun& L, int a, int64_t row0, const T* x, int64_t N, int64_t in,
                        std::vector<T>& buf) {
  if (!L.train || L.dropout <= 0) return x;
  const uint64_t key = lora_dropout_key(L.seed, L.nonce, a);
  const T keep = T(1 / (1 - L.dropout));
  buf.resize(size_t(N * in));
  for (int64_t i = 0; i < N * in; ++i) buf[size_t(i)] = dropout_drops(key, row0 * in + i, L.dropout) ? T(0) : x[i] * keep;
  return buf.data();
}

// The lora_A id of the adapter on parameter `id` when this call has one to run (lora_B is the next id), else -1.
template <class T> static int adapter_of(const ParamView<T>& P, int id, int64_t N) {
  return P.lora && N > 0 ? P.lora->table->lora_a(id) : -1;
}

// Rank-r GEMMs (cblas through ops::gemm): u [N, r] = xd A^T, then y += scale u B^T.
template <class T>
void lora_fwd(const ParamView<T>& P, int id, const T* x, int64_t N, T* y, int64_t ldy, int64_t o0, int64_t nout,
              int64_t row0) {
  const int a = adapter_of(P, id, N);
  if (a < 0) return;
  const int64_t r = P.lora->table->param(a).shape[0], in = P.lora->table->param(a).shape[1];
  if (nout < 0) nout = P.lora->table->param(a + 1).shape[0] - o0;
  std::vector<T> buf, u(size_t(N * r));
  ops::gemm(false, true, N, r, in, T(1), dropped(*P.lora, a, row0, x, N, in, buf), in, P.p[a], in, T(0), u.data(), r);
  ops::gemm(false, true, N, nout, r, T(P.lora->scale), u.data(), r, P.p[a + 1] + o0 * r, r, T(1), y, ldy);
}

template <class T>
void lora_bwd(const ParamView<T>& P, int id, const T* dy, int64_t lddy, const T* x, int64_t N, T* dx, int64_t o0,
              int64_t nout, int64_t row0) {
  const int a = adapter_of(P, id, N);
  if (a < 0) return;
  const int64_t r = P.lora->table->param(a).shape[0], in = P.lora->table->param(a).shape[1];
  if (nout < 0) nout = P.lora->table->param(a + 1).shape[0] - o0;
  std::vector<T> buf, u(size_t(N * r)), du(size_t(N * r));
  const T* xd = dropped(*P.lora, a, row0, x, N, in, buf);
  const T *A = P.p[a], *B = P.p[a + 1] + o0 * r;
  T *dA = P.g[a], *dB = P.g[a + 1];
  const T s = T(P.lora->scale);
  ops::gemm(false, true, N, r, in, T(1), xd, in, A, in, T(0), u.data(), r);  // recomputed: r is small next to out
  // y = s u B^T: dB[o0 + j] += s dy_j^T u, du = s dy B.
  if (dB) ops::gemm(true, false, nout, r, N, s, dy, lddy, u.data(), r, T(1), dB + o0 * r, r);
  ops::gemm(false, false, N, r, nout, s, dy, lddy, B, r, T(0), du.data(), r);
  // u = xd A^T: dA += du^T xd, dxd = du A, dx += dropout mask * dxd (the mask's scale included: dxd -> xd/x).
  if (dA) ops::gemm(true, false, r, in, N, T(1), du.data(), r, xd, in, T(1), dA, in);
  if (!dx) return;
  if (xd == x) {
    ops::gemm(false, false, N, in, r, T(1), du.data(), r, A, in, T(1), dx, in);
    return;
  }
  std::vector<T> dxd(size_t(N * in));
  ops::gemm(false, false, N, in, r, T(1), du.data(), r, A, in, T(0), dxd.data(), in);
  const T keep = T(1 / (1 - P.lora->dropout));
  const uint64_t key = lora_dropout_key(P.lora->seed, P.lora->nonce, a);
  for (int64_t i = 0; i < N * in; ++i)
    if (!dropout_drops(key, row0 * in + i, P.lora->dropout)) dx[i] += dxd[size_t(i)] * keep;
}

#define Q3VL_INST(T)                                                                                          \
  template void lora_fwd<T>(const ParamView<T>&, int, const T*, int64_t, T*, int64_t, int64_t, int64_t,     \
                            int64_t);                                                                        \
  template void lora_bwd<T>(const ParamView<T>&, int, const T*, int64_t, const T*, int64_t, T*, int64_t,     \
                            int64_t, int64_t);
Q3VL_INST(float)
Q3VL_INST(double)
#undef Q3VL_INST

}  // namespace q3vl
