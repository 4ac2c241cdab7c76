// Videos in the device model (CPU op layer): a video of grid [T, h, w] is, in the vision tower, the embedding merge,
// DeepStack and M-RoPE, T temporal patches each handled as an image grid [1, h, w] whose placeholder is
// video_token_id (transformers' Qwen3VLModel: get_rope_index repeats video_grid_thw to T grids of t = 1, the tower
// attends within each temporal patch). Checked against that sequence built by hand, with positions worked out by
// hand, on batches mixing images, videos and text-only rows. Golden parity with transformers: test_golden.cpp's
// video cases (tools/make_video_goldens.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <random>
#include <span>

#include "../compare.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_model.hpp"
#include "../reference/layers.hpp"
#include "q3vl/train/eval.hpp"
#include "tiny_model.hpp"

namespace {

using namespace q3vl;

constexpr int64_t S0 = 58, E0 = 59, IMG = 60, VID = 61;

ModelConfig video_tiny(bool moe) {
  ModelConfig c = test::tiny(moe, !moe);
  c.video_token_id = VID;
  return c;
}

void span(std::vector<int64_t>& r, int64_t id, int n) {
  r.push_back(S0);
  r.insert(r.end(), size_t(n), id);
  r.push_back(E0);
}

std::vector<float> rows(std::mt19937& rng, int n) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(size_t(n) * 1536);
  for (float& x : v) x = nd(rng);
  return v;
}

// Row 0: text, video X [2,4,4] (two temporal patches of 4 tokens, text between them as the timestamps), text,
// image A [1,2,6] (3 tokens), text. Row 1: text only, left-padded. Row 2: image B [1,4,4], video Y [3,2,4] (three
// patches of 2 tokens), text. Right-padded to S.
struct Pair {
  Batch video;  // with pixel_values_videos / video_grid_thw
  Batch image;  // the same as images [1, h, w] in sequence order (the hand-built transformers equivalent)
};

Pair mixed_batch() {
  std::mt19937 rng(5);
  std::vector<int64_t> r0 = {1, 2}, r1, r2 = {6};
  span(r0, VID, 4), r0.push_back(3), span(r0, VID, 4), r0.push_back(4), span(r0, IMG, 3), r0.push_back(5);
  for (int k = 0; k < 12; ++k) r1.push_back(7 + k);
  span(r2, IMG, 4), r2.push_back(8);
  for (int p = 0; p < 3; ++p) r2.push_back(20 + p), span(r2, VID, 2);
  r2.push_back(9);
  const int S = int(std::max({r0.size(), r1.size() + 3, r2.size()}));
  Pair out;
  Batch& b = out.video;
  b.B = 3, b.S = S;
  for (int r = 0; r < 3; ++r) {
    std::vector<int64_t> ids = r == 0 ? r0 : r == 1 ? r1 : r2;
    std::vector<int64_t> mask(ids.size(), 1);
    if (r == 1) {  // left pad
      ids.insert(ids.begin(), size_t(S) - ids.size(), 0);
      mask.insert(mask.begin(), size_t(S) - mask.size(), 0);
    }
    mask.resize(size_t(S), 0), ids.resize(size_t(S), 0);
    b.input_ids.insert(b.input_ids.end(), ids.begin(), ids.end());
    b.attention_mask.insert(b.attention_mask.end(), mask.begin(), mask.end());
  }
  b.labels = b.input_ids;
  for (size_t i = 0; i < b.labels.size(); ++i)
    if (!b.attention_mask[i] || b.labels[i] == IMG || b.labels[i] == VID || b.labels[i] == S0) b.labels[i] = -100;
  const auto X = rows(rng, 2 * 16), A = rows(rng, 12), B = rows(rng, 16), Y = rows(rng, 3 * 8);
  b.pixel_values = A, b.pixel_values.insert(b.pixel_values.end(), B.begin(), B.end());
  b.image_grid_thw = {1, 2, 6, 1, 4, 4};
  b.pixel_values_videos = X, b.pixel_values_videos.insert(b.pixel_values_videos.end(), Y.begin(), Y.end());
  b.video_grid_thw = {2, 4, 4, 3, 2, 4};

  Batch& h = out.image;  // X0 X1 A | B Y0 Y1 Y2, all as images
  h = b;
  h.pixel_values_videos.clear(), h.video_grid_thw.clear();
  for (int64_t& id : h.input_ids) id = id == VID ? IMG : id;
  h.image_grid_thw = {1, 4, 4, 1, 4, 4, 1, 2, 6, 1, 4, 4, 1, 2, 4, 1, 2, 4, 1, 2, 4};
  h.pixel_values = X;
  for (const auto* v : {&A, &B, &Y}) h.pixel_values.insert(h.pixel_values.end(), v->begin(), v->end());
  return out;
}

TEST(VideoModel, MropePositionsByHand) {
  const ModelConfig cfg = video_tiny(false);
  const Pair p = mixed_batch();
  const TokenStream s = token_stream(p.video);
  const VisualInput v = visual_input(cfg, s.ids, p.video.pixel_values, p.video.image_grid_thw,
                                     p.video.pixel_values_videos, p.video.video_grid_thw);
  EXPECT_EQ(v.grid, p.image.image_grid_thw);
  EXPECT_EQ(v.pixels, p.image.pixel_values);
  const auto pos = mrope_positions(cfg, s.ids.data(), s.cu, v.grid);
  const int64_t N = int64_t(s.ids.size());
  // Row 0: 1 2 <s> [X0: 2x2 merged] </s> 3 <s> [X1] </s> 4 <s> [A: 1x3 merged] </s> 5.
  const std::vector<std::array<int64_t, 3>> want = {
      {0, 0, 0},    {1, 1, 1},    {2, 2, 2},    {3, 3, 3},    {3, 3, 4},    {3, 4, 3},    {3, 4, 4},
      {5, 5, 5},    {6, 6, 6},    {7, 7, 7},    {8, 8, 8},    {8, 8, 9},    {8, 9, 8},    {8, 9, 9},
      {10, 10, 10}, {11, 11, 11}, {12, 12, 12}, {13, 13, 13}, {13, 13, 14}, {13, 13, 15}, {16, 16, 16},
      {17, 17, 17}};
  ASSERT_GE(s.cu.size(), 4u);
  ASSERT_EQ(s.cu[1], int64_t(want.size()));
  for (size_t i = 0; i < want.size(); ++i)
    for (int a = 0; a < 3; ++a) EXPECT_EQ(pos[size_t(a * N) + i], want[i][size_t(a)]) << "token " << i << " axis " << a;
  // Row 2: 6 <s> [B 2x2] </s> 8, then 3 x (text, <s>, [Y_t: 1x2], </s>), 9.
  const int64_t r2 = s.cu[2];
  EXPECT_EQ(pos[size_t(r2)], 0);
  EXPECT_EQ(pos[size_t(r2 + 2)], 2);   // B's first token: (2, 2, 2)
  EXPECT_EQ(pos[size_t(r2 + 6)], 4);   // </s> after B: 2 + max(1, 2, 2)
  EXPECT_EQ(pos[size_t(r2 + 7)], 5);   // 8
  EXPECT_EQ(pos[size_t(r2 + 10)], 8);  // Y0 after "20 <s>": (8, 8, 8), (8, 8, 9)
  EXPECT_EQ(pos[size_t(N + r2 + 11)], 8);
  EXPECT_EQ(pos[size_t(2 * N + r2 + 11)], 9);
  EXPECT_EQ(pos[size_t(r2 + 12)], 10);  // </s>: 8 + max(1, 1, 2)
  EXPECT_EQ(pos[size_t(r2 + 23)], 21);  // 9 at the end: Y1 at 13, Y2 at 18, </s> 20
}

TEST(VideoModel, BadVideoInputsNamed) {
  const ModelConfig cfg = video_tiny(false);
  Pair p = mixed_batch();
  const TokenStream s = token_stream(p.video);
  auto expect_fail = [&](const Batch& b, const std::string& want) {
    try {
      visual_input(cfg, s.ids, b.pixel_values, b.image_grid_thw, b.pixel_values_videos, b.video_grid_thw);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  Batch b = p.video;
  b.video_grid_thw = {2, 4, 4};  // Y missing (and its pixels still there)
  expect_fail(b, "video_grid_thw covers 32 patches, the pixels 56");
  b.pixel_values_videos.resize(32 * 1536);
  expect_fail(b, "video tokens at position");
  b = p.video;
  b.video_grid_thw = {1, 4, 4, 4, 2, 4};  // X as one patch: its second span is taken as Y's
  b.pixel_values_videos.resize((16 + 32) * 1536);
  expect_fail(b, "video 1 needs exactly 2 placeholder tokens at position 10");
}

// Loss, logits and every gradient of the video batch equal those of its hand-built image equivalent, bitwise on the
// CPU op layer (the same ops on the same rows in the same order).
void equivalence(bool moe) {
  const ModelConfig cfg = video_tiny(moe);
  BasicModel<float> host(cfg);
  host.init_random(11, 0.3);
  const Pair p = mixed_batch();
  dev::Exec ex = dev::make_exec(Device::CPU);
  double loss[2];
  std::vector<float> logits[2], g[2];
  for (int k = 0; k < 2; ++k) {
    const Batch& b = k == 0 ? p.video : p.image;
    DevModel m(cfg, ex, DType::F32);
    m.reserve(budget_for(b, cfg.vision.patch_dim()));
    m.set_params(host.params());
    m.zero_grads();
    loss[k] = m.forward(b, true, &logits[k], nullptr, moe);
    m.backward();
    g[k].resize(size_t(m.table().total()));
    m.grads_to_host(g[k].data());
  }
  dev::destroy_exec(ex);
  ASSERT_TRUE(std::isfinite(loss[0]));
  EXPECT_EQ(loss[0], loss[1]);
  EXPECT_EQ(test::max_diff(logits[0], logits[1]), 0.0);
  EXPECT_EQ(test::max_diff(g[0], g[1]), 0.0);
  // The vision tower is trained through the video: its patch embedding has a gradient.
  const ParamTable& t = host.table();
  const int pe = t.find("model.visual.patch_embed.proj.weight");
  const ParamInfo& pi = t.param(pe);
  const std::span<const float> gp(g[0].data() + t.units()[size_t(pi.unit)].offset + pi.offset, size_t(pi.numel));
  EXPECT_GT(test::max_abs(gp), 0.0);
  // And the video matters: other pixels, other loss.
  Batch other = p.video;
  for (float& v : other.pixel_values_videos) v = -v;
  dev::Exec ex2 = dev::make_exec(Device::CPU);
  {
    DevModel m(cfg, ex2, DType::F32);
    m.reserve(budget_for(other, cfg.vision.patch_dim()));
    m.set_params(host.params());
    EXPECT_NE(m.forward(other, false, nullptr, nullptr, moe), loss[0]);
  }
  dev::destroy_exec(ex2);
}

TEST(VideoModel, EqualsTemporalPatchesAsImagesDense) { equivalence(false); }
TEST(VideoModel, EqualsTemporalPatchesAsImagesMoe) { equivalence(true); }

}  // namespace
