// Unit hooks (what ZeRO-3 streams through): every unit use is announced in Model::unit_order()'s order, calls
// nest properly, and a model without full storage whose units are bound only between before_* and after_*
// computes bitwise the same loss and gradients as one that owns its storage. Also the MFU FLOP count, checked
// against the parameter table's matrix sizes.
#include <gtest/gtest.h>

#include <random>

#include "../reference/qwen3vl.hpp"
#include "q3vl/train/flops.hpp"

using namespace q3vl;

namespace {

ModelConfig tiny(bool moe, bool tie) {
  ModelConfig c;
  c.vision.depth = 3;
  c.vision.hidden = 16;
  c.vision.intermediate = 24;
  c.vision.heads = 2;
  c.vision.num_position_embeddings = 16;
  c.vision.out_hidden = 16;
  c.vision.deepstack_indexes = {0, 2};  // the last tap is the block before the main merger: consecutive uses
  c.text.vocab = 64;
  c.text.hidden = 16;
  c.text.intermediate = 24;
  c.text.layers = 2;
  c.text.heads = 2;
  c.text.kv_heads = 1;
  c.text.head_dim = 8;
  c.text.mrope_section = {2, 1, 1};
  c.text.tie_embeddings = tie;
  if (moe) {
    c.text.num_experts = 4;
    c.text.experts_per_tok = 2;
    c.text.moe_intermediate = 8;
    c.text.mlp_only_layers = {1};
  }
  c.image_token_id = 60;
  c.vision_start_token_id = 58;
  c.vision_end_token_id = 59;
  return c;
}

// Two samples: text + one [1,4,4] image (4 merged tokens) + text; text only.
PackedBatch batch(const ModelConfig& c, bool images) {
  PackedBatch b;
  b.input_ids = {1, 2, 58, 60, 60, 60, 60, 59, 3, 4, 7, 8, 9, 10, 11};
  if (!images)
    for (auto& t : b.input_ids) t = t >= 58 ? 5 : t;
  b.cu_seqlens = {0, 10, 15};
  b.labels = b.input_ids;
  if (images) {
    b.image_grid_thw = {1, 4, 4};
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    b.pixel_values.resize(16 * size_t(c.vision.patch_dim()));
    for (float& v : b.pixel_values) v = nd(rng);
  }
  return b;
}

// Binds each unit to its own buffers only while in use; records the calls.
struct Binder : UnitHooks {
  Model& m;
  std::vector<std::vector<float>> p, g;
  std::vector<int> fwd, bwd, open;
  Binder(Model& m, const Model& src) : m(m) {
    for (const UnitInfo& u : src.table().units()) {
      const float* s = const_cast<Model&>(src).params() + u.offset;
      p.emplace_back(s, s + u.numel);
      g.emplace_back(u.numel, 0.f);
    }
  }
  void on(int u, std::vector<int>& log, bool grads) {
    log.push_back(u);
    open.push_back(u);
    m.bind_unit(u, p[u].data(), grads ? g[u].data() : nullptr);
  }
  void off(int u) {
    ASSERT_FALSE(open.empty());
    ASSERT_EQ(open.back(), u) << "hook calls must nest";
    open.pop_back();
    m.bind_unit(u, nullptr, nullptr);
  }
  void before_forward(int u) override { on(u, fwd, false); }
  void after_forward(int u) override { off(u); }
  void before_backward(int u) override { on(u, bwd, true); }
  void after_backward(int u) override { off(u); }
};

bool subsequence(const std::vector<int>& a, const std::vector<int>& of) {
  size_t k = 0;
  for (int x : a) {
    while (k < of.size() && of[k] != x) ++k;
    if (k++ == of.size()) return false;
  }
  return true;
}

}  // namespace

TEST(UnitHooks, StreamedUnitsGiveTheSameLossAndGradients) {
  for (bool moe : {false, true})
    for (bool tie : {false, true})
      for (bool images : {true, false}) {
        SCOPED_TRACE(std::string(moe ? "moe" : "dense") + (tie ? " tied" : " untied") + (images ? " images" : " text"));
        const ModelConfig cfg = tiny(moe, tie);
        Model ref(cfg);
        ref.init_random(3, 0.2);
        const PackedBatch b = batch(cfg, images);
        ref.zero_grads();
        const double want = ref.forward(b, true, nullptr, nullptr, moe);
        ref.backward();

        Model m(cfg);
        Binder h(m, ref);
        m.release_storage();
        EXPECT_EQ(m.params(), nullptr);
        m.set_hooks(&h);
        const double got = m.forward(b, true, nullptr, nullptr, moe);
        m.backward();
        EXPECT_EQ(got, want);
        EXPECT_TRUE(h.open.empty());
        if (images) {  // every unit used: exactly the announced order
          EXPECT_EQ(h.fwd, m.unit_order(false));
          EXPECT_EQ(h.bwd, m.unit_order(true));
        } else {
          EXPECT_TRUE(subsequence(h.fwd, m.unit_order(false)));
          EXPECT_TRUE(subsequence(h.bwd, m.unit_order(true)));
          EXPECT_LT(h.fwd.size(), m.unit_order(false).size());
        }
        for (size_t u = 0; u < h.g.size(); ++u) {
          const UnitInfo& ui = ref.table().units()[u];
          for (int64_t j = 0; j < ui.numel; ++j)
            ASSERT_EQ(h.g[u][size_t(j)], ref.grads()[ui.offset + j]) << ui.name << "[" << j << "]";
        }
      }
}

TEST(Flops, MatchesTheParameterTable) {
  for (bool moe : {false, true}) {
    const ModelConfig cfg = tiny(moe, false);
    const ParamTable t(cfg);
    const PackedBatch b = batch(cfg, true);
    const FlopCounts c = count_flops({b});
    EXPECT_EQ(c.tokens, 15);
    EXPECT_EQ(c.text_keys, 10 * 11 / 2 + 5 * 6 / 2);
    EXPECT_EQ(c.patches, 16);
    EXPECT_EQ(c.vision_keys, 16 * 16);
    // Matrix weights per token from the table: 2-D weights of the layers; MoE experts: k of E.
    double text_w = 0, vis_w = 0, merger_w = 0;
    for (const ParamInfo& p : t.params()) {
      const bool matrix = p.shape.size() >= 2 && p.name.find("pos_embed") == std::string::npos;
      if (!matrix) continue;
      if (p.name.find("language_model.layers.") != std::string::npos)
        text_w += p.shape.size() == 3 ? double(p.numel) * cfg.text.experts_per_tok / cfg.text.num_experts : double(p.numel);
      else if (p.name.find("merger") != std::string::npos)
        merger_w += double(p.numel);
      else if (p.name.find("visual.") != std::string::npos)
        vis_w += double(p.numel);
    }
    const double V = cfg.text.vocab, H = cfg.text.hidden, d = cfg.text.heads * cfg.text.head_dim;
    const double fwd = 2 * text_w * 15 + 4 * d * c.text_keys * cfg.text.layers + 2 * V * H * 15 + 2 * vis_w * 16 +
                       2 * merger_w * 4 + 4 * cfg.vision.hidden * 256 * cfg.vision.depth;
    EXPECT_NEAR(train_flops(t, c), 3 * fwd, 1e-9 * fwd);
  }
}
