// A tiny Qwen3-VL (dense or MoE, tied or not) and a padded two-sample batch with two images of different grids:
// shared by the whole-model tests (gradient checks, LoRA).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "../reference/qwen3vl.hpp"

namespace q3vl::test {

inline ModelConfig tiny(bool moe, bool tie) {
  ModelConfig c;
  c.vision.depth = 2;
  c.vision.hidden = 32;
  c.vision.intermediate = 48;
  c.vision.heads = 2;
  c.vision.num_position_embeddings = 16;  // 4x4 table
  c.vision.out_hidden = 32;
  c.vision.deepstack_indexes = {0};
  c.text.vocab = 64;
  c.text.hidden = 32;
  c.text.intermediate = 40;
  c.text.layers = 2;
  c.text.heads = 4;
  c.text.kv_heads = 2;
  c.text.head_dim = 8;
  c.text.mrope_section = {2, 1, 1};
  c.text.rope_theta = 10000;
  c.text.tie_embeddings = tie;
  if (moe) {
    c.text.num_experts = 4;
    c.text.experts_per_tok = 2;
    c.text.moe_intermediate = 16;
    c.text.mlp_only_layers = {1};  // one MoE and one dense layer
  }
  c.image_token_id = 60;
  c.vision_start_token_id = 58;
  c.vision_end_token_id = 59;
  return c;
}

// Row 0: text, image [1,4,4] (4 tokens), text, image [1,2,6] (3 tokens), text, one pad on the right.
// Row 1: text only, left-padded by 3.
inline Batch tiny_batch(std::mt19937& rng) {
  Batch b;
  b.B = 2;
  b.S = 16;
  std::vector<int64_t> r0 = {1, 2, 58, 60, 60, 60, 60, 59, 3, 58, 60, 60, 60, 59, 5, 0};
  std::vector<int64_t> r1 = {0, 0, 0, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  b.input_ids = r0;
  b.input_ids.insert(b.input_ids.end(), r1.begin(), r1.end());
  b.attention_mask.assign(32, 1);
  b.attention_mask[15] = 0;
  b.attention_mask[16] = b.attention_mask[17] = b.attention_mask[18] = 0;
  b.labels = b.input_ids;
  for (size_t i = 0; i < b.labels.size(); ++i)
    if (b.attention_mask[i] == 0 || b.labels[i] == 60 || i == 0 || i == 19) b.labels[i] = -100;
  b.image_grid_thw = {1, 4, 4, 1, 2, 6};
  std::normal_distribution<float> nd(0.f, 1.f);
  b.pixel_values.resize((16 + 12) * 1536);
  for (auto& v : b.pixel_values) v = nd(rng);
  return b;
}

// Central differences of the loss at `reps` random elements of parameter `id`, each against its analytic gradient
// (after forward(b, true) and backward()) to abs_tol + 1e-5 relative. The weights are left as they were.
inline void fd_check(BasicModel<double>& m, const Batch& b, bool aux, int id, std::mt19937& rng, int reps,
                     double abs_tol) {
  const ParamInfo& p = m.table().param(id);
  double* w = m.param(id);
  const double* g = m.grad(id);
  std::uniform_int_distribution<int64_t> pick(0, 1 << 30);
  for (int rep = 0; rep < reps; ++rep) {
    const int64_t j = pick(rng) % p.numel;
    const double w0 = w[j], h = 1e-5;
    w[j] = w0 + h;
    const double lp = m.forward(b, false, nullptr, nullptr, aux);
    w[j] = w0 - h;
    const double lm = m.forward(b, false, nullptr, nullptr, aux);
    w[j] = w0;
    const double num = (lp - lm) / (2 * h);
    EXPECT_NEAR(g[j], num, abs_tol + 1e-5 * std::fabs(num)) << p.name << " [" << j << "]";
  }
}

}  // namespace q3vl::test
