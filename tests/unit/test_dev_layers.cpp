// Layers on the device op layer against the templated CPU layers (layers.hpp), dense and MoE: on the CPU in fp32
// they must compute the same numbers; on a GPU in fp32 within summation-order error, in bf16 within rounding error.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "../compare.hpp"
#include "../gpu.hpp"
#include "q3vl/model/dev_layers.hpp"
#include "../reference/qwen3vl.hpp"
#include "q3vl/tensor/ops.hpp"

using namespace q3vl;
using test::rel_max_diff;  // NaN and Inf fail (compare.hpp)

namespace {

ModelConfig layer_cfg(bool moe) {
  ModelConfig c;
  c.vision.depth = 1;
  c.vision.hidden = 32;
  c.vision.intermediate = 48;
  c.vision.heads = 2;
  c.vision.num_position_embeddings = 16;
  c.vision.out_hidden = 64;
  c.vision.deepstack_indexes = {0};
  c.text.vocab = 64;
  c.text.hidden = 64;
  c.text.intermediate = 96;
  c.text.layers = 1;
  c.text.heads = 4;
  c.text.kv_heads = 2;
  c.text.head_dim = 64;  // a kernel head dim
  c.text.mrope_section = {8, 12, 12};
  if (moe) c.text.num_experts = 8, c.text.experts_per_tok = 2, c.text.moe_intermediate = 40;
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

// Runs the dense or MoE decoder layer through the templates and through the device layer on `target` in `dt`;
// returns the largest normalised error over the output, dx and every weight gradient.
double decoder_vs_template(bool moe, Device target, DType dt) {
  const ModelConfig cfg = layer_cfg(moe);
  const TextConfig& tc = cfg.text;
  Model m(cfg);
  m.init_random(3, 0.08);
  const ParamTable& T = m.table();
  const int f = T.layer(0);
  std::mt19937 g(5);
  const int64_t N = 150, H = tc.hidden, hd = tc.head_dim, E = moe ? tc.num_experts : 0, k = moe ? tc.experts_per_tok : 0;
  const std::vector<int64_t> cu{0, 1, 70, 150};
  auto x0 = randn(N * H, g), dy = randn(N * H, g), aux = randn(N * E, g, 0.1f);
  std::vector<float> cs(N * hd / 2), sn(N * hd / 2);
  for (size_t i = 0; i < cs.size(); ++i) cs[i] = std::cos(0.37f * i), sn[i] = std::sin(0.37f * i);

  // Reference: the templated layer on the model's own storage.
  std::vector<float*> pp, gp;
  for (size_t i = 0; i < T.params().size(); ++i) pp.push_back(m.param(int(i))), gp.push_back(m.grad(int(i)));
  m.zero_grads();
  DecoderCtx<float> c;
  std::vector<float> x = x0, dx = dy, probs(N * E);
  std::vector<int64_t> idx(N * k);
  decoder_layer_fwd(cfg, ParamView<float>{pp.data(), gp.data()}, f, moe, x.data(), N, cu, cs.data(), sn.data(),
                    probs.data(), idx.data(), c);
  decoder_layer_bwd(cfg, ParamView<float>{pp.data(), gp.data()}, f, moe, dx.data(), N, cu, cs.data(), sn.data(),
                    probs.data(), idx.data(), moe ? aux.data() : nullptr, c);

  // Device layer: parameters in dt, F32 gradients, arenas sized by counting first.
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
  Arena count;
  DevDecoderCtx dc;
  DevDecoderScratch ds;
  dc.carve(count, tc, moe, N, dt);
  ds.carve(count, tc, moe, N, dt);
  Arena arena{static_cast<char*>(dev::alloc(ex, count.used)), count.used};
  dc.carve(arena, tc, moe, N, dt);
  ds.carve(arena, tc, moe, N, dt);
  EXPECT_EQ(arena.used, count.used);
  std::vector<int32_t> cu32(cu.begin(), cu.end());
  auto* dcu = static_cast<int32_t*>(dev::alloc(ex, cu32.size() * 4));
  dev::to_device(ex, dcu, cu32.data(), cu32.size() * 4);
  auto* dcos = static_cast<float*>(up(ex, cs, DType::F32));
  auto* dsin = static_cast<float*>(up(ex, sn, DType::F32));
  void* dxv = up(ex, x0, dt);
  auto* dprobs = static_cast<float*>(dev::alloc(ex, std::max<int64_t>(1, N * E) * 4));
  auto* didx = static_cast<int32_t*>(dev::alloc(ex, std::max<int64_t>(1, N * k) * 4));
  const DevSegments seg{dcu, 3, 80};
  const DevParams P{dp.data(), dg.data()};
  dev_decoder_fwd(ex, cfg, P, f, moe, dxv, N, seg, dcos, dsin, dprobs, didx, dc, ds, dt);
  const auto xo = down(ex, dxv, N * H, dt);
  void* ddx = up(ex, dy, dt);
  void* daux = moe ? up(ex, aux, DType::F32) : nullptr;  // the router's gradients are fp32
  dev_decoder_bwd(ex, cfg, P, f, moe, ddx, N, seg, dcos, dsin, dprobs, didx, daux, dc, ds, dt);
  const auto dxo = down(ex, ddx, N * H, dt);
  const auto go = down(ex, dgrads, T.total(), DType::F32);

  double worst = std::max(rel_max_diff(xo, x), rel_max_diff(dxo, dx));
  std::printf("  decoder %-5s %-4s %-4s out %.2e dx %.2e", moe ? "moe" : "dense", target == Device::CUDA ? "cuda" : "cpu",
              dtype_name(dt), rel_max_diff(xo, x), rel_max_diff(dxo, dx));
  for (int id = f; id < f + tlay::count; ++id) {
    const ParamInfo& p = T.param(id);
    const int64_t off = T.units()[p.unit].offset + p.offset;
    const std::vector<float> a(go.begin() + off, go.begin() + off + p.numel), b(m.grad(id), m.grad(id) + p.numel);
    worst = std::max(worst, rel_max_diff(a, b));
  }
  std::printf(" worst grad/out %.2e\n", worst);
  for (void* p : {dparams, (void*)dgrads, (void*)arena.base, (void*)dcu, (void*)dcos, (void*)dsin, dxv, (void*)dprobs,
                  (void*)didx, ddx})
    dev::release(ex, p);
  if (daux) dev::release(ex, daux);
  dev::destroy_exec(ex);
  return worst;
}

}  // namespace

// Same ops in the same order on the CPU: equal up to the MoE unpermute's summation order.
TEST(DevLayers, DecoderCpuMatchesTemplates) {
  EXPECT_LE(decoder_vs_template(false, Device::CPU, DType::F32), 1e-6);
  EXPECT_LE(decoder_vs_template(true, Device::CPU, DType::F32), 1e-5);
}

TEST(DevLayers, DecoderCudaMatchesCpu) {
  Q3VL_NEED_GPU();
  EXPECT_LE(decoder_vs_template(false, Device::CUDA, DType::F32), 1e-4);
  EXPECT_LE(decoder_vs_template(true, Device::CUDA, DType::F32), 1e-4);
  EXPECT_LE(decoder_vs_template(false, Device::CUDA, DType::BF16), 3e-2);
  // In bf16 the router logits carry bf16 rounding, so near-tied tokens pick another expert than the fp32 reference
  // and that expert's weight gradients differ by O(10%) (0.22 measured on the H200; fp32 above: 1e-6). Indexing bugs
  // give O(1). The model-level golden test bounds bf16 MoE against transformers.
  EXPECT_LE(decoder_vs_template(true, Device::CUDA, DType::BF16), 0.35);
}
