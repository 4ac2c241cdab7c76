// Layer-level gradient checks in double precision (vision block, both mergers, dense and MoE decoder layers) and
// the M-RoPE position ids of the worked example in spec 4.6.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "gradcheck.hpp"
#include "../reference/qwen3vl.hpp"
#include "q3vl/tensor/ops.hpp"

using namespace q3vl;
using q3vl::test::dot;
using q3vl::test::randn;
using Vd = std::vector<double>;

namespace {

ModelConfig small_cfg(bool moe) {
  ModelConfig c;
  c.vision.depth = 1;
  c.vision.hidden = 16;
  c.vision.intermediate = 24;
  c.vision.heads = 2;
  c.vision.num_position_embeddings = 16;
  c.vision.out_hidden = 16;
  c.vision.deepstack_indexes = {0};
  c.text.vocab = 32;
  c.text.hidden = 16;
  c.text.intermediate = 20;
  c.text.layers = 1;
  c.text.heads = 4;
  c.text.kv_heads = 2;
  c.text.head_dim = 8;
  c.text.mrope_section = {2, 1, 1};
  if (moe) c.text.num_experts = 4, c.text.experts_per_tok = 2, c.text.moe_intermediate = 6;
  c.image_token_id = 30;
  return c;
}

}  // namespace

// Central differences on a few random entries of each parameter of a layer.
static void gradcheck_params(BasicModel<double>& m, int first, int count, const std::function<double()>& f,
                             std::mt19937& rng, const char* what) {
  std::uniform_int_distribution<int64_t> pick(0, 1 << 30);
  for (int id = first; id < first + count; ++id) {
    const ParamInfo& p = m.table().param(id);
    for (int rep = 0; rep < 4; ++rep) {
      const int64_t j = pick(rng) % p.numel;
      double* w = m.param(id);
      const double w0 = w[j], h = 1e-5;
      w[j] = w0 + h;
      const double fp = f();
      w[j] = w0 - h;
      const double fm = f();
      w[j] = w0;
      const double num = (fp - fm) / (2 * h);
      EXPECT_NEAR(m.grad(id)[j], num, 1e-7 + 1e-6 * std::fabs(num)) << what << " " << p.name << "[" << j << "]";
    }
  }
}

TEST(ModelLayers, VisionBlockGrad) {
  const ModelConfig cfg = small_cfg(false);
  BasicModel<double> m(cfg);
  m.init_random(1, 0.3);
  std::mt19937 rng(2);
  const std::vector<int64_t> grid = {1, 2, 4, 1, 2, 2};  // two images, 8 + 4 patches
  const int64_t N = 12, D = 16, hd = 8;
  std::vector<int64_t> row, col;
  vision_patch_coords(grid, 2, row, col);
  const auto cu = vision_cu_seqlens(grid);
  ASSERT_EQ(cu, (std::vector<int64_t>{0, 8, 12}));
  Vd cs(N * hd / 2), sn(N * hd / 2);
  ops::vision_rope_table(row.data(), col.data(), N, hd, cs.data(), sn.data());
  std::vector<double*> pp, gp;
  for (size_t i = 0; i < m.table().params().size(); ++i) pp.push_back(m.param((int)i)), gp.push_back(m.grad((int)i));
  const ParamView<double> V{pp.data(), gp.data()};
  const int f = m.table().vision_block(0);
  Vd x0 = randn(N * D, rng), R = randn(N * D, rng);
  VisionBlockCtx<double> c;
  auto F = [&] {
    Vd x = x0;
    vision_block_fwd(cfg.vision, V, f, x.data(), N, cu, cs.data(), sn.data(), c);
    return dot(x, R);
  };
  F();
  m.zero_grads();
  Vd dx = R;
  vision_block_bwd(cfg.vision, V, f, dx.data(), N, cu, cs.data(), sn.data(), c);
  q3vl::test::expect_grad("vision block dx", x0, dx, F, {0, 5, 17, 40, 99, 150, 191}, 1e-6);
  gradcheck_params(m, f, vblk::count, F, rng, "vision block");
}

TEST(ModelLayers, MergerGrads) {
  const ModelConfig cfg = small_cfg(false);
  BasicModel<double> m(cfg);
  m.init_random(3, 0.3);
  std::mt19937 rng(4);
  std::vector<double*> pp, gp;
  for (size_t i = 0; i < m.table().params().size(); ++i) pp.push_back(m.param((int)i)), gp.push_back(m.grad((int)i));
  const ParamView<double> V{pp.data(), gp.data()};
  const int64_t N = 8, D = 16, M = 2, Dout = 16;
  for (int post = 0; post < 2; ++post) {
    // Norm params are random too so their gradients are generic.
    const int f = post ? m.table().deepstack_merger(0) : m.table().merger();
    for (int k = 0; k < 2; ++k)
      for (int64_t j = 0; j < m.table().param(f + k).numel; ++j) m.param(f + k)[j] += 0.1 * std::sin(j + k);
    Vd x0 = randn(N * D, rng), R = randn(M * Dout, rng);
    MergerCtx<double> c;
    auto F = [&] {
      Vd y(M * Dout);
      merger_fwd(cfg.vision, V, f, post, x0.data(), N, y.data(), c);
      return dot(y, R);
    };
    F();
    m.zero_grads();
    Vd dx(N * D);
    merger_bwd(cfg.vision, V, f, post, R.data(), N, dx.data(), c);
    q3vl::test::expect_grad(post ? "deepstack merger dx" : "merger dx", x0, dx, F, {}, 1e-6);
    gradcheck_params(m, f, vmrg::count, F, rng, post ? "deepstack merger" : "merger");
  }
  // Pre- vs post-shuffle norm differ: same weights give different outputs.
  Vd x = randn(N * D, rng), y1(M * Dout), y2(M * Dout);
  MergerCtx<double> c;
  merger_fwd(cfg.vision, V, m.table().merger(), false, x.data(), N, y1.data(), c);
  // Copy main-merger fc weights into the deepstack merger, norms to 1/0: outputs must still differ.
  const int a = m.table().merger(), b = m.table().deepstack_merger(0);
  for (int k = vmrg::fc1_w; k < vmrg::count; ++k)
    std::copy(m.param(a + k), m.param(a + k) + m.table().param(a + k).numel, m.param(b + k));
  std::fill(m.param(b), m.param(b) + 4 * D, 1.0);
  std::fill(m.param(b + 1), m.param(b + 1) + 4 * D, 0.0);
  std::fill(m.param(a), m.param(a) + D, 1.0);
  std::fill(m.param(a + 1), m.param(a + 1) + D, 0.0);
  merger_fwd(cfg.vision, V, a, false, x.data(), N, y1.data(), c);
  merger_fwd(cfg.vision, V, b, true, x.data(), N, y2.data(), c);
  EXPECT_GT(std::fabs(y1[0] - y2[0]) + std::fabs(y1[5] - y2[5]), 1e-6);
}

static void decoder_case(bool moe) {
  const ModelConfig cfg = small_cfg(moe);
  BasicModel<double> m(cfg);
  m.init_random(5, 0.3);
  std::mt19937 rng(6);
  std::vector<double*> pp, gp;
  for (size_t i = 0; i < m.table().params().size(); ++i) pp.push_back(m.param((int)i)), gp.push_back(m.grad((int)i));
  const ParamView<double> V{pp.data(), gp.data()};
  const int64_t N = 9, H = 16, hd = 8, E = 4, k = 2;
  const std::vector<int64_t> cu = {0, 4, 9};  // two packed samples
  std::vector<int64_t> pos3(3 * N);
  for (int64_t i = 0; i < N; ++i) pos3[i] = i, pos3[N + i] = i + 1, pos3[2 * N + i] = 2 * i;
  const int sec[3] = {2, 1, 1};
  Vd cs(N * hd / 2), sn(N * hd / 2);
  ops::mrope_table(pos3.data(), N, hd, 10000.0, sec, cs.data(), sn.data());
  const int f = m.table().layer(0);
  for (int id : {f + tlay::in_norm, f + tlay::q_norm, f + tlay::k_norm, f + tlay::post_norm})
    for (int64_t j = 0; j < m.table().param(id).numel; ++j) m.param(id)[j] += 0.2 * std::cos(3.0 * j + id);
  Vd x0 = randn(N * H, rng), R = randn(N * H, rng), Ra = randn(N * E, rng);
  Vd probs(N * E);
  std::vector<int64_t> idx(N * k);
  DecoderCtx<double> c;
  // For MoE also pass a fixed upstream gradient on the router logits (as the aux loss does): f += <logits, Ra>.
  Vd router_logits(N * E);
  auto F = [&] {
    Vd x = x0;
    decoder_layer_fwd(cfg, V, f, moe, x.data(), N, cu, cs.data(), sn.data(), moe ? probs.data() : nullptr,
                      moe ? idx.data() : nullptr, c);
    double extra = 0;
    if (moe) {
      ops::linear_fwd(c.ln2.data(), m.param(f + tlay::router), (const double*)nullptr, router_logits.data(), N, H, E);
      extra = dot(router_logits, Ra);
    }
    return dot(x, R) + extra;
  };
  F();
  m.zero_grads();
  Vd dx = R;
  decoder_layer_bwd(cfg, V, f, moe, dx.data(), N, cu, cs.data(), sn.data(), moe ? probs.data() : nullptr,
                    moe ? idx.data() : nullptr, moe ? Ra.data() : nullptr, c);
  q3vl::test::expect_grad(moe ? "moe layer dx" : "decoder layer dx", x0, dx, F, {0, 7, 33, 70, 101, 143}, 1e-6);
  gradcheck_params(m, f, tlay::count, F, rng, moe ? "moe layer" : "decoder layer");
}

TEST(ModelLayers, DecoderLayerDenseGrad) { decoder_case(false); }
TEST(ModelLayers, DecoderLayerMoeGrad) { decoder_case(true); }

TEST(ModelLayers, MropePositionsWorkedExample) {
  // Spec 4.6: four text tokens, then an image of grid [1,86,128] (2752 tokens, merged 43x64), then vision_end.
  ModelConfig cfg;
  std::vector<int64_t> ids = {151644, 872, 198, 151652};
  ids.insert(ids.end(), 2752, 151655);
  ids.push_back(151653);
  ids.push_back(74785);
  const std::vector<int64_t> cu = {0, (int64_t)ids.size()};
  const auto pos = mrope_positions(cfg, ids.data(), cu, {1, 86, 128});
  const int64_t N = (int64_t)ids.size();
  for (int64_t i = 0; i < 4; ++i)
    for (int r = 0; r < 3; ++r) EXPECT_EQ(pos[r * N + i], i);
  // Image token (br, bc) = (1, 2) is at 4 + 1*64 + 2.
  const int64_t t = 4 + 64 + 2;
  EXPECT_EQ(pos[t], 4);
  EXPECT_EQ(pos[N + t], 5);
  EXPECT_EQ(pos[2 * N + t], 6);
  EXPECT_EQ(pos[N + 4 + 2751], 4 + 42);
  EXPECT_EQ(pos[2 * N + 4 + 2751], 4 + 63);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(pos[r * N + 4 + 2752], 68);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(pos[r * N + 4 + 2753], 69);
  // Too few image tokens for the grid is an error naming the image.
  ids.erase(ids.begin() + 10);
  const std::vector<int64_t> cu2 = {0, (int64_t)ids.size()};
  EXPECT_THROW(mrope_positions(cfg, ids.data(), cu2, {1, 86, 128}), std::exception);
}
