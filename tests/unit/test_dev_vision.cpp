// The vision tower and mergers on the device op layer against the templated CPU layers (vision.cpp, merger.cpp):
// patch + position embedding -> one ViT block (head dim 72, as the real 1152/16 tower) -> DeepStack (postshuffle)
// and main mergers, forward and backward, over two images and a two-frame video of different grids. On the CPU in
// fp32 they must compute the same numbers; on a GPU in fp32 within summation-order error, in bf16 within rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <utility>

#include "../compare.hpp"
#include "../gpu.hpp"
#include "q3vl/model/dev_vision.hpp"
#include "../reference/layers.hpp"
#include "q3vl/model/params.hpp"
#include "../reference/qwen3vl.hpp"
#include "q3vl/tensor/ops.hpp"

using namespace q3vl;
using test::rel_max_diff;  // NaN and Inf fail (compare.hpp)

namespace {

ModelConfig vision_cfg() {
  ModelConfig c;
  c.vision.depth = 1;
  c.vision.hidden = 144;
  c.vision.intermediate = 96;
  c.vision.heads = 2;  // head dim 72: the real tower's, a padded kernel head dim
  c.vision.num_position_embeddings = 16;
  c.vision.out_hidden = 64;
  c.vision.deepstack_indexes = {0};
  c.text.vocab = 64;
  c.text.hidden = 64;
  c.text.intermediate = 96;
  c.text.layers = 1;
  c.text.heads = 4;
  c.text.kv_heads = 2;
  c.text.head_dim = 64;
  c.text.mrope_section = {8, 12, 12};
  c.image_token_id = 60;
  return c;
}

std::vector<float> randn(int64_t n, std::mt19937& g, float s = 1) {
  std::normal_distribution<float> d(0, s);
  std::vector<float> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

std::vector<float> down(const dev::Exec& ex, const void* p, int64_t n, DType dt) {
  std::vector<float> v(n);
  if (dt == DType::F32) return dev::to_host(ex, v.data(), p, n * 4), v;
  std::vector<uint16_t> h(n);
  dev::to_host(ex, h.data(), p, n * 2);
  for (int64_t i = 0; i < n; ++i) v[i] = dt == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
  return v;
}
void* up(const dev::Exec& ex, const std::vector<float>& v, DType dt) {
  void* f = dev::alloc(ex, v.size() * 4);
  dev::to_device(ex, f, v.data(), v.size() * 4);
  if (dt == DType::F32) return f;
  void* d = dev::alloc(ex, v.size() * dtype_size(dt));
  dev::convert(ex, d, dt, f, DType::F32, int64_t(v.size()));
  dev::synchronize(ex);
  dev::release(ex, f);
  return d;
}

// Runs embed -> block -> DeepStack merger + main merger and back through the templates and through the device
// layers on `target` in `dt`; returns the largest normalised error over every output, input gradient and weight
// gradient of the four parameter groups.
double vision_vs_template(Device target, DType dt) {
  const ModelConfig cfg = vision_cfg();
  const VisionConfig& vc = cfg.vision;
  Model m(cfg);
  m.init_random(7, 0.08);
  const ParamTable& T = m.table();
  const int fe = T.vision_embed(), fb = T.vision_block(0), fm = T.merger(), fd = T.deepstack_merger(0);
  const std::pair<int, int> groups[] = {{fe, vemb::count}, {fb, vblk::count}, {fm, vmrg::count}, {fd, vmrg::count}};
  std::mt19937 g(11);
  // init_random sets norms to 1 and biases to 0: move them off so that every bias and norm weight shows.
  for (auto [first, count] : groups)
    for (int id = first; id < first + count; ++id)
      if (T.param(id).no_decay) {
        const auto noise = randn(T.param(id).numel, g, 0.2f);
        for (int64_t i = 0; i < T.param(id).numel; ++i) m.param(id)[i] += noise[i];
      }

  const std::vector<int64_t> grid{1, 4, 6, 1, 8, 6, 2, 2, 4};  // 24 + 48 + 2x8 patches: segments 24, 48, 8, 8
  const int64_t Np = 88, M = Np / 4, Dv = vc.hidden, Dout = vc.out_hidden, hd = vc.head_dim();
  const auto pix = randn(Np * vc.patch_dim(), g), dimg = randn(M * Dout, g), dds = randn(M * Dout, g);
  std::vector<int64_t> row, col;
  vision_patch_coords(grid, vc.merge, row, col);
  std::vector<float> cs(Np * hd / 2), sn(Np * hd / 2);
  ops::vision_rope_table(row.data(), col.data(), Np, hd, cs.data(), sn.data());
  const std::vector<int64_t> cu = vision_cu_seqlens(grid);
  EXPECT_EQ(cu.back(), Np);

  // Reference: the templated layers on the model's own storage.
  std::vector<float*> pp, gp;
  for (size_t i = 0; i < T.params().size(); ++i) pp.push_back(m.param(int(i))), gp.push_back(m.grad(int(i)));
  m.zero_grads();
  const ParamView<float> PV{pp.data(), gp.data()};
  std::vector<float> x(Np * Dv);
  vision_embed_fwd(vc, PV, fe, pix.data(), grid, Np, x.data());
  const std::vector<float> xe = x;
  VisionBlockCtx<float> bc;
  vision_block_fwd(vc, PV, fb, x.data(), Np, cu, cs.data(), sn.data(), bc);
  MergerCtx<float> mc, dc;
  std::vector<float> img(M * Dout), ds(M * Dout), dv(Np * Dv, 0.f);
  merger_fwd(vc, PV, fd, true, x.data(), Np, ds.data(), dc);
  merger_fwd(vc, PV, fm, false, x.data(), Np, img.data(), mc);
  merger_bwd(vc, PV, fm, false, dimg.data(), Np, dv.data(), mc);
  merger_bwd(vc, PV, fd, true, dds.data(), Np, dv.data(), dc);  // joins the main merger's gradient
  const std::vector<float> dvm = dv;
  vision_block_bwd(vc, PV, fb, dv.data(), Np, cu, cs.data(), sn.data(), bc);
  vision_embed_bwd(vc, PV, fe, pix.data(), grid, Np, dv.data());

  // Device layers: parameters in dt, F32 gradients, arenas sized by counting first.
  dev::Exec ex = dev::make_exec(target);
  const std::vector<float> all(m.params(), m.params() + T.total());
  void* dparams = up(ex, all, dt);
  auto* dgrads = static_cast<float*>(up(ex, std::vector<float>(T.total(), 0.f), DType::F32));
  std::vector<const void*> dp;
  std::vector<float*> dg;
  for (const ParamInfo& p : T.params()) {
    const int64_t off = T.units()[p.unit].offset + p.offset;
    dp.push_back(at(dparams, off, dt));
    dg.push_back(dgrads + off);
  }
  DevVisionBlockCtx dbc;
  DevVisionScratch dvs;
  DevMergerCtx dmc, ddc;
  DevMergerScratch dms;
  auto carve = [&](Arena& a) {
    dbc.carve(a, vc, Np, dt);
    dvs.carve(a, vc, Np, dt);
    ddc.carve(a, vc, true, Np, dt);
    dmc.carve(a, vc, false, Np, dt);
    dms.carve(a, vc, Np, dt);
  };
  Arena count;
  carve(count);
  Arena arena{static_cast<char*>(dev::alloc(ex, count.used)), count.used};
  carve(arena);
  EXPECT_EQ(arena.used, count.used);
  std::vector<int32_t> cu32(cu.begin(), cu.end());
  int64_t max_len = 0;
  for (size_t i = 0; i + 1 < cu.size(); ++i) max_len = std::max(max_len, cu[i + 1] - cu[i]);
  auto* dcu = static_cast<int32_t*>(dev::alloc(ex, cu32.size() * 4));
  dev::to_device(ex, dcu, cu32.data(), cu32.size() * 4);
  auto* dcos = static_cast<float*>(up(ex, cs, DType::F32));
  auto* dsin = static_cast<float*>(up(ex, sn, DType::F32));
  const DevSegments seg{dcu, int64_t(cu.size()) - 1, max_len};
  const DevParams P{dp.data(), dg.data()};

  void* dpix = up(ex, pix, dt);
  void* dx = dev::alloc(ex, size_t(Np * Dv) * dtype_size(dt));
  dev_vision_embed_fwd(ex, vc, P, fe, dpix, grid, Np, dx, dt);
  const auto xe_d = down(ex, dx, Np * Dv, dt);
  dev_vision_block_fwd(ex, vc, P, fb, dx, Np, seg, dcos, dsin, dbc, dvs, dt);
  const auto xb_d = down(ex, dx, Np * Dv, dt);
  void* dimg_o = dev::alloc(ex, size_t(M * Dout) * dtype_size(dt));
  void* dds_o = dev::alloc(ex, size_t(M * Dout) * dtype_size(dt));
  dev_merger_fwd(ex, vc, P, fd, true, dx, Np, dds_o, ddc, dt);
  dev_merger_fwd(ex, vc, P, fm, false, dx, Np, dimg_o, dmc, dt);
  const auto img_d = down(ex, dimg_o, M * Dout, dt), ds_d = down(ex, dds_o, M * Dout, dt);
  void* ddimg = up(ex, dimg, dt);
  void* ddds = up(ex, dds, dt);
  void* ddv = dev::alloc(ex, size_t(Np * Dv) * dtype_size(dt));
  dev_merger_bwd(ex, vc, P, fm, false, ddimg, Np, ddv, false, dmc, dms, dt);  // writes ddv, unzeroed
  dev_merger_bwd(ex, vc, P, fd, true, ddds, Np, ddv, true, ddc, dms, dt);
  const auto dvm_d = down(ex, ddv, Np * Dv, dt);
  dev_vision_block_bwd(ex, vc, P, fb, ddv, Np, seg, dcos, dsin, dbc, dvs, dt);
  const auto dvb_d = down(ex, ddv, Np * Dv, dt);
  dev_vision_embed_bwd(ex, vc, P, fe, dpix, grid, Np, ddv, dt);
  const auto go = down(ex, dgrads, T.total(), DType::F32);

  const double e_emb = rel_max_diff(xe_d, xe), e_blk = rel_max_diff(xb_d, x), e_img = rel_max_diff(img_d, img);
  const double e_ds = rel_max_diff(ds_d, ds);
  const double e_dvm = rel_max_diff(dvm_d, dvm), e_dvb = rel_max_diff(dvb_d, dv);
  double worst = std::max({e_emb, e_blk, e_img, e_ds, e_dvm, e_dvb}), wgrad = 0;
  for (auto [first, cnt] : groups)
    for (int id = first; id < first + cnt; ++id) {
      const ParamInfo& p = T.param(id);
      const int64_t off = T.units()[p.unit].offset + p.offset;
      const std::vector<float> a(go.begin() + off, go.begin() + off + p.numel), b(m.grad(id), m.grad(id) + p.numel);
      const double e = rel_max_diff(a, b);
      wgrad = std::max(wgrad, e);
      if (e > 1e-3) std::printf("    %s: %.2e\n", p.name.c_str(), e);
    }
  std::printf("  vision %-4s %-4s embed %.2e block %.2e merger %.2e deepstack %.2e dx(mergers) %.2e dx(block) %.2e "
              "worst grad %.2e\n",
              target == Device::CUDA ? "cuda" : "cpu", dtype_name(dt), e_emb, e_blk, e_img, e_ds, e_dvm, e_dvb, wgrad);
  worst = std::max(worst, wgrad);
  for (void* p : {dparams, (void*)dgrads, (void*)arena.base, (void*)dcu, (void*)dcos, (void*)dsin, dpix, dx, dimg_o,
                  dds_o, ddimg, ddds, ddv})
    dev::release(ex, p);
  dev::destroy_exec(ex);
  return worst;
}

}  // namespace

// Same ops in the same order on the CPU: the same numbers.
TEST(DevVision, CpuMatchesTemplates) { EXPECT_LE(vision_vs_template(Device::CPU, DType::F32), 1e-6); }

TEST(DevVision, CudaMatchesCpu) {
  Q3VL_NEED_GPU();
  EXPECT_LE(vision_vs_template(Device::CUDA, DType::F32), 1e-4);
  EXPECT_LE(vision_vs_template(Device::CUDA, DType::BF16), 6e-2);
}
