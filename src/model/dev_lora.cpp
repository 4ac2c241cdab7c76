// LoRA beside the device model's linears (model/lora.hpp's semantics on the dev:: op layer): u = drop(x) A^T, then
// y += scale u B^T, the same GEMMs in the same order as lora.cpp, so the CPU op layer computes what the host
// templates compute; the dropout mask is the same counter hash on every device.
#include <algorithm>
#include <string>

#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_layers.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"

namespace q3vl {

void DevLora::carve(Arena& a, const ModelConfig& cfg, int64_t tokens, int64_t patches, DType dt) {
  u = du = xd = nullptr, rows = elems = 0;
  if (!cfg.lora.on()) return;
  const TextConfig& tc = cfg.text;
  const VisionConfig& vc = cfg.vision;
  // The widest input of a wrapped linear, per kind of row: text (hidden, attention output, MLP inner), vision
  // (hidden, MLP inner); the mergers' [P/4, 4 Dv] rows hold as many elements as [P, Dv].
  const int64_t text_in = std::max<int64_t>({tc.hidden, int64_t(tc.heads) * tc.head_dim, tc.intermediate});
  const int64_t vis_in = patches ? std::max<int64_t>(vc.hidden, vc.intermediate) : 0;
  rows = std::max(tokens, patches);
  elems = cfg.lora.dropout > 0 ? std::max(tokens * text_in, patches * vis_in) : 0;
  u = a.take(rows * cfg.lora.rank, dt), du = a.take(rows * cfg.lora.rank, dt);
  xd = elems ? a.take(elems, dt) : nullptr;
}

namespace {
struct Adapter {
  int a = -1;  // lora_A id (lora_B: a + 1)
  int64_t r = 0, in = 0, out = 0;
};
Adapter adapter_of(const DevParams& P, int id, int64_t N) {
  if (!P.lora || !P.lora->table || N <= 0) return {};
  const ParamTable& t = *P.lora->table;
  const int a = t.lora_a(id);
  if (a < 0) return {};
  return {a, t.param(a).shape[0], t.param(a).shape[1], t.param(a + 1).shape[0]};
}
bool drops(const DevLora& L) { return L.train && L.dropout > 0; }
// drop(x) into the scratch (or x itself without dropout).
const void* dropped(const dev::Exec& ex, const DevLora& L, const Adapter& A, const void* x, int64_t N, int64_t row0,
                    DType dt) {
  if (!drops(L)) return x;
  Q3VL_CHECK(N * A.in <= L.elems, "LoRA dropout scratch of " + std::to_string(L.elems) + " elements, " +
                                      std::to_string(N * A.in) + " needed (sizing and use disagree)");
  dev::dropout_fwd(ex, x, L.xd, N * A.in, L.dropout, lora_dropout_key(L.seed, L.nonce, A.a), row0 * A.in, dt);
  return L.xd;
}
void check_rows(const DevLora& L, int64_t N) {
  Q3VL_CHECK(N <= L.rows, "LoRA scratch of " + std::to_string(L.rows) + " rows, " + std::to_string(N) +
                              " needed (sizing and use disagree)");
}
}  // namespace

bool dev_lora_on(const DevParams& P, int id) { return adapter_of(P, id, 1).a >= 0; }

void dev_lora_fwd(const dev::Exec& ex, const DevParams& P, int id, const void* x, int64_t N, void* y, int64_t ldy,
                  DType dt, int64_t o0, int64_t nout, int64_t row0, bool y_f32) {
  const Adapter A = adapter_of(P, id, N);
  if (A.a < 0) return;
  const DevLora& L = *P.lora;
  check_rows(L, N);
  if (nout < 0) nout = A.out - o0;
  const void* xd = dropped(ex, L, A, x, N, row0, dt);
  dev::gemm(ex, false, true, N, A.r, A.in, 1.f, xd, A.in, P.p[A.a], A.in, 0.f, L.u, A.r, dt, dt);
  dev::gemm(ex, false, true, N, nout, A.r, L.scale, L.u, A.r, at(P.p[A.a + 1], o0 * A.r, dt), A.r, 1.f, y, ldy, dt,
            y_f32 ? DType::F32 : dt);
}

void dev_lora_bwd(const dev::Exec& ex, const DevParams& P, int id, const void* dy, int64_t lddy, const void* x,
                  int64_t N, void* dx, DType dt, int64_t o0, int64_t nout, int64_t row0) {
  const Adapter A = adapter_of(P, id, N);
  if (A.a < 0) return;
  const DevLora& L = *P.lora;
  check_rows(L, N);
  if (nout < 0) nout = A.out - o0;
  const void *W_A = P.p[A.a], *B = at(P.p[A.a + 1], o0 * A.r, dt);
  float *dA = P.g[A.a], *dB = P.g[A.a + 1];
  dev_grad_zeroed(ex, P, A.a);  // adds: a call may cover a slice of B's rows (qkv's)
  dev_grad_zeroed(ex, P, A.a + 1);
  const void* xd = dropped(ex, L, A, x, N, row0, dt);
  // u recomputed (r is small next to the linear's width); y = s u B^T: dB += s dy^T u, du = s dy B.
  dev::gemm(ex, false, true, N, A.r, A.in, 1.f, xd, A.in, W_A, A.in, 0.f, L.u, A.r, dt, dt);
  if (dB) dev::gemm(ex, true, false, nout, A.r, N, L.scale, dy, lddy, L.u, A.r, 1.f, dB + o0 * A.r, A.r, dt, DType::F32);
  dev::gemm(ex, false, false, N, A.r, nout, L.scale, dy, lddy, B, A.r, 0.f, L.du, A.r, dt, dt);
  // u = xd A^T: dA += du^T xd, d(xd) = du A, and dx += the dropout mask's image of d(xd).
  if (dA) dev::gemm(ex, true, false, A.r, A.in, N, 1.f, L.du, A.r, xd, A.in, 1.f, dA, A.in, dt, DType::F32);
  if (!dx) return;
  if (xd == x) return dev::gemm(ex, false, false, N, A.in, A.r, 1.f, L.du, A.r, W_A, A.in, 1.f, dx, A.in, dt, dt);
  dev::gemm(ex, false, false, N, A.in, A.r, 1.f, L.du, A.r, W_A, A.in, 0.f, L.xd, A.in, dt, dt);  // xd is spent
  dev::dropout_bwd(ex, L.xd, dx, N * A.in, L.dropout, lora_dropout_key(L.seed, L.nonce, A.a), row0 * A.in, dt);
}

}  // namespace q3vl
