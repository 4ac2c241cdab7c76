// The engine (serve/engine.hpp) offline, as `q3vl generate` drives it, at 1, 2 and 4 ranks (the model tensor-parallel
// over them, the other ranks following rank 0's steps): a prompt's answer does not depend on what runs beside it
// (continuous batching of one sequence or of all, alone or with the others; greedy, and seeded sampling, where prompt
// i draws from the stream of (seed, i) whatever its batch), banned and stop tokens never appear in an answer, and
// answers are deterministic. The HF golden model dense_tied (vocabulary 256), prompts with images of three grids.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "ranks.hpp"
#include "q3vl/core/deck.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/serve/engine.hpp"

using namespace q3vl;

namespace {

const std::string kModel = "tests/data/golden/dense_tied/model";

// Three prompts: two images of different grids, one image, text only.
std::vector<GenPrompt> prompts(const ModelConfig& cfg) {
  auto image = [&](GenPrompt& p, int64_t h, int64_t w) {
    p.ids.push_back(cfg.vision_start_token_id);
    p.ids.insert(p.ids.end(), h * w / 4, cfg.image_token_id);
    p.ids.push_back(cfg.vision_end_token_id);
    p.grid.insert(p.grid.end(), {1, h, w});
    for (int64_t i = 0; i < h * w * cfg.vision.patch_dim(); ++i)
      p.pixels.push_back(std::sin(0.001f * float(i) + float(p.ids.size())));
  };
  std::vector<GenPrompt> ps(3);
  ps[0].ids = {1, 2};
  image(ps[0], 4, 4);
  ps[0].ids.insert(ps[0].ids.end(), {3, 4});
  image(ps[0], 2, 6);
  ps[0].ids.push_back(5);
  ps[1].ids = {7};
  image(ps[1], 6, 2);
  ps[1].ids.insert(ps[1].ids.end(), {8, 9, 10, 11});
  ps[2].ids = {12, 13, 14, 15, 16, 17, 18, 19, 20};
  return ps;
}

// generate's engine for batch sequences at once: the answers on rank 0 (the other ranks follow its steps).
std::vector<GenResult> answers(int batch, const std::vector<GenPrompt>& ps, const SamplingParams& sp, size_t first) {
  const Deck d = Deck::parse("", "test", {"model.hf=" + kModel, "generate.batch=" + std::to_string(batch)}, "check");
  Engine e(d, generate_config(d, load_hf_config(kModel + "/config.json"), ps, sp.max_new_tokens));
  e.load();
  if (e.runner.rank() != 0) {
    e.runner.follow();
    return {};
  }
  e.scheduler.configure(e.config, nullptr, sp);
  std::vector<GenResult> r = e.generate(ps, sp, first);
  e.runner.stop();
  return r;
}

}  // namespace

TEST(Engine, OfflineAnswersDoNotDependOnBatching) {
  const bool root = test::placement().rank == 0;
  const ModelConfig cfg = load_hf_config(kModel + "/config.json");
  const std::vector<GenPrompt> ps = prompts(cfg);
  std::vector<std::vector<int64_t>> first;  // each temperature's answer to prompt 0
  for (double temp : {0.0, 1.0}) {
    SamplingParams sp;
    sp.max_new_tokens = 9;
    sp.temperature = temp;
    sp.seed = 99;
    sp.stop = {cfg.eos_token_id};
    sp.banned = {cfg.image_token_id, cfg.video_token_id};
    const auto together = answers(3, ps, sp, 0);
    const auto one_at_a_time = answers(1, ps, sp, 0);
    for (size_t i = 0; i < ps.size(); ++i) {
      const auto alone = answers(3, {ps[i]}, sp, i);
      if (!root) continue;
      ASSERT_EQ(together.size(), ps.size());
      EXPECT_EQ(alone[0].tokens, together[i].tokens) << "prompt " << i << " temperature " << temp;
      EXPECT_EQ(alone[0].stopped, together[i].stopped);
      EXPECT_EQ(one_at_a_time[i].tokens, together[i].tokens) << "prompt " << i << " temperature " << temp;
      EXPECT_TRUE(together[i].stopped || together[i].tokens.size() == 9u) << together[i].tokens.size();
      for (int64_t t : together[i].tokens)
        EXPECT_TRUE(t != cfg.image_token_id && t != cfg.video_token_id && t != cfg.eos_token_id)
            << "banned or stop token " << t;
    }
    const auto again = answers(3, ps, sp, 0);
    for (size_t i = 0; root && i < ps.size(); ++i) EXPECT_EQ(again[i].tokens, together[i].tokens) << "not deterministic";
    if (root) first.push_back(together[0].tokens);
  }
  if (root) {
    EXPECT_NE(first[0], first[1]) << "sampling gave the greedy answer";
  }
}
