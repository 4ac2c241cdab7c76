// Expert parallelism on the device model (DESIGN.md "Expert parallelism"; tests/reference/moe.cpp is the host
// model's): the rows a rank gathered for each expert (expert-major, so each owner's are contiguous) go by all-to-all
// to the ranks owning their experts, which run them expert-major through their E/ep experts' grouped GEMMs and send
// the outputs back (dispatch, combine); backward sends the output gradients the same way and the input gradients
// back. Dropless, and every row gets the arithmetic it gets with every expert local: only rows of other ranks join an
// expert's GEMM.
//
// The gradient rows an owner receives already carry their rank's micro-step weight (each rank's backward starts from
// its weighted loss), so the owner's expert weight gradients need no per-rank scale (ExpertExchange::scales(), which
// the test reference's host model applies: it scales gradients after the backward).
#include <string>
#include <vector>

#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_layers.hpp"
#include "q3vl/model/params.hpp"

namespace q3vl {

namespace {

// The dispatch's plan, on the host: the rows this rank sends each group rank (its buckets of that rank's experts,
// from the device's start[E+1]: a dispatch's one device-to-host copy), the rows it receives (the counts' all-to-all),
// and the arrived rows' expert-major order (expert j's rows from rank 0, then rank 1, ...: moe.cpp's), uploaded to
// c.perm (each one's arrival row) and c.ostart.
void route(const dev::Exec& ex, const TextConfig& tc, int64_t N, DevDecoderCtx& c) {
  const int G = c.ex->size();
  const int64_t E = tc.num_experts, El = E / G;
  std::vector<int32_t> start(size_t(E + 1), 0);
  if (N > 0) dev::to_host(ex, start.data(), c.start, start.size() * 4);
  std::vector<int64_t> send(static_cast<size_t>(E)), recv(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) send[size_t(e)] = start[size_t(e + 1)] - start[size_t(e)];
  c.ex->counts(send.data(), recv.data(), El);  // recv[p*El + j]: rank p's rows for this rank's expert j
  c.send_rows.assign(size_t(G), 0), c.recv_rows.assign(size_t(G), 0);
  std::vector<int64_t> at(static_cast<size_t>(E));  // arrival row of (rank p, expert j)'s first row
  int64_t arrived = 0;
  for (int64_t i = 0; i < E; ++i) {
    c.send_rows[size_t(i / El)] += send[size_t(i)], c.recv_rows[size_t(i / El)] += recv[size_t(i)];
    at[size_t(i)] = arrived, arrived += recv[size_t(i)];
  }
  if (arrived > c.ro_cap)
    fail("expert parallelism: " + std::to_string(arrived) + " rows arrived at this rank's experts, more than the " +
         std::to_string(c.ro_cap) + " its buffers were sized for (parallel.ep x the micro-batch's tokens x "
         "num_experts_per_tok): the group's ranks were sized for different micro-batches");
  std::vector<int32_t> perm, ostart(size_t(El + 1), 0);
  perm.reserve(size_t(arrived));
  for (int64_t j = 0; j < El; ++j) {
    for (int p = 0; p < G; ++p)
      for (int64_t i = 0; i < recv[size_t(p * El + j)]; ++i) perm.push_back(int32_t(at[size_t(p * El + j)] + i));
    ostart[size_t(j + 1)] = int32_t(perm.size());
  }
  c.ro = arrived;
  if (arrived > 0) dev::to_device(ex, c.perm, perm.data(), perm.size() * 4);
  dev::to_device(ex, c.ostart, ostart.data(), ostart.size() * 4);
}

}  // namespace

void dev_moe_experts_fwd(const dev::Exec& ex, const TextConfig& tc, const DevParams& P, int f, int64_t N,
                         DevDecoderCtx& c, DevDecoderScratch& s, DType dt) {
  const int64_t H = tc.hidden, k = tc.experts_per_tok, Im = tc.moe_intermediate, El = tc.num_experts / c.ex->size();
  route(ex, tc, N, c);
  const int64_t Ro = c.ro;
  c.ex->rows(s.xg, c.send_rows, s.arr, c.recv_rows, H, dt);
  if (Ro > 0) {
    dev::gather_rows(ex, s.arr, c.perm, 1, c.xo, Ro, H, dt);  // expert-major, kept for the weight gradients
    dev::grouped_linear_fwd(ex, c.xo, P.p[dev_experts_id(P, f)], c.ostart, c.egu, Ro, El, H, 2 * Im, dt);
    dev::swiglu_fwd(ex, c.egu, s.eact, Ro, Im, dt);
    dev::grouped_linear_fwd(ex, s.eact, P.p[dev_experts_id(P, f) + 1], c.ostart, s.yo, Ro, El, Im, H, dt);
    dev::scatter_rows(ex, s.yo, c.perm, s.arr, Ro, H, false, dt);  // back in arrival order
  }
  c.ex->rows(s.arr, c.recv_rows, c.ey, c.send_rows, H, dt);
  if (N > 0) dev::moe_combine_fwd(ex, c.ey, c.pos, c.w, s.tmp, N, k, H, dt);
}

void dev_moe_experts_bwd(const dev::Exec& ex, const TextConfig& tc, const DevParams& P, int f, const void* dout,
                         int64_t N, DevDecoderCtx& c, DevDecoderScratch& s, DType dt) {
  const int64_t H = tc.hidden, k = tc.experts_per_tok, Im = tc.moe_intermediate, El = tc.num_experts / c.ex->size();
  const int64_t Ro = c.ro;
  const int gu = dev_experts_id(P, f), down = gu + 1;
  if (N > 0) dev::moe_combine_bwd(ex, dout, c.ey, c.pos, c.w, s.dw, s.dyg, N, k, H, false, dt);
  c.ex->rows(s.dyg, c.send_rows, s.arr, c.recv_rows, H, dt);  // output gradients to the owners
  if (Ro > 0) {
    dev::gather_rows(ex, s.arr, c.perm, 1, s.yo, Ro, H, dt);
    dev::swiglu_fwd(ex, c.egu, s.eact, Ro, Im, dt);  // recomputed, cheaper than keeping it
    const DevGradOut dg = dev_grad_out(ex, P, down);
    dev::grouped_linear_bwd(ex, s.yo, s.eact, P.p[down], c.ostart, s.edact, P.g[down], Ro, El, Im, H, false, dg.adds,
                            dt, dg.sq);
    dev::swiglu_bwd(ex, s.edact, c.egu, s.edgu, Ro, Im, false, dt);
    const DevGradOut gg = dev_grad_out(ex, P, gu);
    dev::grouped_linear_bwd(ex, s.edgu, c.xo, P.p[gu], c.ostart, s.yo, P.g[gu], Ro, El, H, 2 * Im, false, gg.adds, dt,
                            gg.sq);
    dev::scatter_rows(ex, s.yo, c.perm, s.arr, Ro, H, false, dt);
  }
  c.ex->rows(s.arr, c.recv_rows, s.dxg, c.send_rows, H, dt);  // input gradients back, in s.xg's order
}

}  // namespace q3vl
