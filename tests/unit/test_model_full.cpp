// Whole-model gradient checks (double precision, central differences on a random subset of every parameter
// tensor) for a tiny dense and a tiny MoE Qwen3-VL: two images of different grids in one sequence plus a
// left-padded text-only sample; plus padded-vs-packed consistency, the parameter table and the weight loader.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "gradcheck.hpp"
#include "tiny_model.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/io/safetensors.hpp"
#include "../reference/qwen3vl.hpp"
#include "../reference/model_io.hpp"

using namespace q3vl;
using q3vl::test::tiny;
using q3vl::test::fd_check;
using q3vl::test::tiny_batch;

namespace {

void check_model(bool moe, bool tie, bool aux) {
  const ModelConfig cfg = tiny(moe, tie);
  BasicModel<double> m(cfg);
  m.init_random(7, 0.3);
  std::mt19937 rng(3);
  const Batch b = tiny_batch(rng);
  // Randomise norm weights/biases too, so their gradients are not special.
  std::normal_distribution<double> nd(0.0, 0.1);
  for (size_t i = 0; i < m.table().params().size(); ++i)
    if (m.table().params()[i].no_decay)
      for (int64_t j = 0; j < m.table().params()[i].numel; ++j) m.param((int)i)[j] += nd(rng);

  m.zero_grads();
  double aux_v = -1;
  const double loss = m.forward(b, true, nullptr, &aux_v, aux);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_GT(m.supervised_tokens(), 10);
  if (moe) {
    EXPECT_GT(aux_v, 0.0);
  }
  m.backward();

  int checked = 0;
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    fd_check(m, b, aux, (int)id, rng, 3, 1e-6);
    checked += 3;
  }
  EXPECT_GT(checked, 100);
}

}  // namespace

TEST(ModelFull, DenseGradcheck) { check_model(false, false, false); }
TEST(ModelFull, DenseTiedGradcheck) { check_model(false, true, false); }
TEST(ModelFull, MoeGradcheckWithAux) { check_model(true, false, true); }

// Recomputation reruns each block's forward on its saved input: the gradients must be bitwise those of the
// kept-activation backward (dense and MoE with the aux loss; vision, DeepStack), with fewer activation bytes kept.
TEST(ModelFull, RecomputeIsBitwiseAndKeepsLess) {
  for (bool moe : {false, true}) {
    ModelConfig cfg = tiny(moe, false);
    cfg.text.layers = 6;  // enough blocks for the kept inputs to be well below the full contexts
    cfg.vision.depth = 4;
    Model a(cfg), b(cfg);
    a.init_random(5, 0.3);
    b.init_random(5, 0.3);
    b.set_recompute(true);
    std::mt19937 rng(9);
    const Batch batch = tiny_batch(rng);
    double la = 0, lb = 0;
    for (int rep = 0; rep < 2; ++rep) {  // twice: grads accumulate, contexts are rebuilt
      la += a.forward(batch, true, nullptr, nullptr, moe);
      a.backward();
      lb += b.forward(batch, true, nullptr, nullptr, moe);
      b.backward();
    }
    EXPECT_EQ(la, lb);
    for (size_t id = 0; id < a.table().params().size(); ++id)
      for (int64_t j = 0; j < a.table().params()[id].numel; ++j)
        ASSERT_EQ(a.grad(int(id))[j], b.grad(int(id))[j]) << a.table().params()[id].name << " [" << j << "]";
    // Kept for backward: everything (a) vs block inputs plus one block's context (b).
    EXPECT_GT(b.activation_peak(), 0);
    EXPECT_LT(double(b.activation_peak()), 0.6 * double(a.activation_peak())) << "moe " << moe;  // pixels and head rows are kept either way
    a.reset_activation_peak();
    EXPECT_EQ(a.activation_peak(), 0);
  }
}

TEST(ModelFull, PaddedEqualsPacked) {
  const ModelConfig cfg = tiny(true, false);
  Model m(cfg);
  m.init_random(11, 0.2);
  std::mt19937 rng(5);
  const Batch b = tiny_batch(rng);
  std::vector<float> lpad, lpack;
  const double l1 = m.forward(b, false, &lpad);
  // The same two samples packed into one stream without padding.
  PackedBatch p;
  p.cu_seqlens = {0};
  for (int r = 0; r < b.B; ++r) {
    for (int t = 0; t < b.S; ++t)
      if (b.attention_mask[r * b.S + t]) {
        p.input_ids.push_back(b.input_ids[r * b.S + t]);
        p.labels.push_back(b.labels[r * b.S + t]);
      }
    p.cu_seqlens.push_back((int64_t)p.input_ids.size());
  }
  p.pixel_values = b.pixel_values;
  p.image_grid_thw = b.image_grid_thw;
  const double l2 = m.forward(p, false, &lpack);
  EXPECT_NEAR(l1, l2, 1e-6);
  // Real positions agree; padded logits are zero.
  const int64_t V = cfg.text.vocab;
  int64_t k = 0;
  for (int64_t i = 0; i < b.B * b.S; ++i) {
    if (!b.attention_mask[i]) {
      EXPECT_EQ(lpad[i * V], 0.f);
      continue;
    }
    for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(lpad[i * V + v], lpack[k * V + v], 1e-5);
    ++k;
  }
  // Padding must not change a sample's result: row 1 alone, unpadded.
  Batch one;
  one.B = 1;
  one.S = 13;
  one.input_ids.assign(b.input_ids.begin() + 19, b.input_ids.end());
  one.labels.assign(b.labels.begin() + 19, b.labels.end());
  std::vector<float> lone;
  m.forward(one, false, &lone);
  for (int64_t i = 0; i < 13 * V; ++i) ASSERT_NEAR(lone[i], lpad[(19 * V) + i], 1e-5);
}

TEST(ModelFull, ImageTokenCountMismatchIsAnError) {
  Model m(tiny(false, false));
  std::mt19937 rng(1);
  Batch b = tiny_batch(rng);
  b.input_ids[3] = 4;  // one image token fewer
  EXPECT_THROW(m.forward(b, false), std::exception);
}

TEST(ModelFull, ParamTableNamesUnitsParts) {
  ModelConfig cfg = tiny(true, false);
  ParamTable t(cfg);
  EXPECT_EQ(t.param(t.id("model.visual.blocks.0.attn.qkv.weight")).shape, (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(t.param(t.id("model.visual.patch_embed.proj.weight")).shape, (std::vector<int64_t>{32, 3, 2, 16, 16}));
  EXPECT_EQ(t.param(t.id("model.language_model.layers.0.mlp.experts.gate_up_proj")).shape,
            (std::vector<int64_t>{4, 32, 32}));
  EXPECT_EQ(t.param(t.id("model.language_model.layers.0.mlp.experts.down_proj")).shape,
            (std::vector<int64_t>{4, 32, 16}));
  EXPECT_GE(t.find("model.language_model.layers.1.mlp.gate_proj.weight"), 0);
  EXPECT_EQ(t.param(t.id("model.visual.merger.linear_fc1.weight")).part, Part::Merger);
  EXPECT_EQ(t.param(t.id("model.visual.deepstack_merger_list.0.norm.weight")).part, Part::Vision);
  EXPECT_EQ(t.param(t.id("model.visual.deepstack_merger_list.0.norm.weight")).shape, (std::vector<int64_t>{128}));
  EXPECT_EQ(t.param(t.id("lm_head.weight")).part, Part::LLM);
  EXPECT_TRUE(t.param(t.id("model.language_model.layers.0.self_attn.q_norm.weight")).no_decay);
  EXPECT_FALSE(t.param(t.id("model.language_model.layers.0.self_attn.q_proj.weight")).no_decay);
  // Units: embed, 2 blocks, mergers, embed_tokens, 2 layers (layer 0's experts a unit of their own), head;
  // contiguous offsets.
  ASSERT_EQ(t.units().size(), 9u);
  EXPECT_EQ(t.units()[size_t(t.param(t.experts(0)).unit)].name, "language_model.layers.0.mlp.experts");
  EXPECT_TRUE(t.units()[size_t(t.param(t.experts(0)).unit)].experts);
  EXPECT_LT(t.experts(1), 0);
  int64_t off = 0;
  for (const auto& u : t.units()) {
    EXPECT_EQ(u.offset, off);
    int64_t in = 0;
    for (int id : u.params) {
      EXPECT_EQ(t.param(id).offset, in);
      in += t.param(id).numel;
    }
    EXPECT_EQ(in, u.numel);
    off += u.numel;
  }
  EXPECT_EQ(off, t.total());
  // Expert parallelism over 2 ranks: rank 1 holds experts 2 and 3 of the [4, ...] tensors (full shapes kept).
  ParamTable half(cfg, ExpertSplit{2, 1});
  const ParamInfo& gu = half.param(half.experts(0));
  EXPECT_EQ(gu.shape, (std::vector<int64_t>{4, 32, 32}));
  EXPECT_EQ(gu.held, gu.numel / 2);
  EXPECT_EQ(gu.held_begin, gu.numel / 2);
  EXPECT_EQ(half.units()[size_t(gu.unit)].numel, t.units()[size_t(gu.unit)].numel / 2);
  EXPECT_EQ(half.total(), t.total() - t.units()[size_t(gu.unit)].numel / 2);
  EXPECT_EQ(half.experts_per_rank(), 2);
  cfg.text.tie_embeddings = true;
  ParamTable tt(cfg);
  EXPECT_LT(tt.find("lm_head.weight"), 0);
  EXPECT_EQ(tt.lm_head(), tt.embed_tokens());
}

TEST(ModelFull, LoadHfWeightsRoundTrip) {
  for (bool v5 : {false, true}) {
    ModelConfig cfg = tiny(true, false);
    cfg.experts_v5_layout = v5;
    Model a(cfg);
    a.init_random(3, 0.5);
    const std::string dir = std::filesystem::temp_directory_path() / ("q3vl_wt_" + std::to_string(getpid()) + (v5 ? "_5" : "_4"));
    std::filesystem::create_directories(dir);
    std::vector<std::vector<float>> keep;
    std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, const float*>>> ts;
    for (size_t id = 0; id < a.table().params().size(); ++id) {
      keep.push_back(to_hf_layout(a.table(), (int)id, a.param((int)id)));
      ts.push_back({a.table().params()[id].name, {hf_shape(a.table(), (int)id), keep.back().data()}});
    }
    const auto& gu = a.table().param(a.table().id("model.language_model.layers.0.mlp.experts.gate_up_proj"));
    EXPECT_EQ(hf_shape(a.table(), a.table().id(gu.name)), (std::vector<int64_t>{4, 32, 32}));  // H == 2Im here
    const int did = a.table().id("model.language_model.layers.0.mlp.experts.down_proj");
    EXPECT_EQ(hf_shape(a.table(), did), (v5 ? std::vector<int64_t>{4, 32, 16} : std::vector<int64_t>{4, 16, 32}));
    write_safetensors(dir + "/model.safetensors", ts);
    Model b(cfg);
    load_hf_weights(b, dir);
    for (int64_t i = 0; i < a.table().total(); ++i) ASSERT_EQ(a.params()[i], b.params()[i]) << i;
    // Grads come back under HF names in the file's layout.
    std::copy(a.params(), a.params() + a.table().total(), b.grads());
    const auto g = grads_hf(b);
    ASSERT_EQ(g.size(), keep.size());
    for (size_t id = 0; id < g.size(); ++id) {
      EXPECT_EQ(g[id].name, ts[id].first);
      EXPECT_EQ(g[id].shape, ts[id].second.first);
      EXPECT_EQ(g[id].data, keep[id]);
    }
    // Released layout: down_proj[e] on disk is [Im, H], the transpose of ours [H, Im].
    if (!v5) {
      EXPECT_EQ(keep[did][1 * 32 + 0], a.param(did)[0 * 16 + 1]);
    }
    // A mis-shaped tensor and a missing one are errors.
    ts[did].second.first = {4, 32, 16};
    if (!v5) {
      write_safetensors(dir + "/model.safetensors", ts);
      EXPECT_THROW(load_hf_weights(b, dir), std::exception);
    }
    ts.erase(ts.begin() + did);
    write_safetensors(dir + "/model.safetensors", ts);
    EXPECT_THROW(load_hf_weights(b, dir), std::exception);
    std::filesystem::remove_all(dir);
  }
}
