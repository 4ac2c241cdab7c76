#include "q3vl/serve/engine.hpp"

#include <algorithm>
#include <memory>

#include "q3vl/core/error.hpp"
#include "q3vl/model/batch.hpp"

namespace q3vl {

EngineConfig generate_config(const Deck& d, const ModelConfig& cfg, const std::vector<GenPrompt>& prompts,
                             int64_t max_new) {
  EngineConfig c;
  c.mode = "generate";
  c.max_batch = d.integer("generate.batch");
  c.lower = "generate.batch, generate.max_new_tokens or generate.max_pixels";
  DevModel::InferBudget& b = c.budget;
  b.block = 16;
  const auto blocks_for = [&](int64_t tokens) { return (tokens + b.block - 1) / b.block; };
  int64_t longest = 0;
  const size_t bs = size_t(c.max_batch);
  for (size_t b0 = 0; b0 < prompts.size(); b0 += bs) {
    int64_t tokens = 0, blocks = 0, n = 0;
    for (size_t i = b0; i < std::min(prompts.size(), b0 + bs); ++i, ++n) {
      const GenPrompt& p = prompts[i];
      const int64_t len = (int64_t)p.ids.size();
      tokens += len;
      blocks += blocks_for(len + max_new);
      longest = std::max(longest, len);
      b.patches = std::max(b.patches, image_patches(cfg.vision, p.pixels.size(), p.grid));
    }
    b.tokens = std::max({b.tokens, tokens, n});
    b.segments = std::max(b.segments, n);
    b.kv_blocks = std::max(b.kv_blocks, blocks);
  }
  b.seq_blocks = blocks_for(longest + max_new);
  c.step_tokens = b.tokens;
  return c;
}

void Engine::load() {
  runner.load();
  metrics.kv_total = blocks.cache().max_blocks;
}

std::vector<GenResult> Engine::generate(std::vector<GenPrompt> prompts, const SamplingParams& sp, size_t first_index) {
  std::vector<GenResult> out(prompts.size());
  if (sp.max_new_tokens <= 0) return out;
  std::vector<std::shared_ptr<Job>> jobs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto j = std::make_shared<Job>();
    j->offline = true;
    j->prompt = std::move(prompts[i]);
    j->sp = sp;
    j->index = first_index + i;
    scheduler.submit(j);
    jobs.push_back(std::move(j));
  }
  scheduler.drain();
  for (size_t i = 0; i < jobs.size(); ++i) {
    Job& j = *jobs[i];
    if (!j.error.empty()) fail(config.mode + ": prompt " + std::to_string(first_index + i + 1) + ": " + j.error);
    out[i].tokens = std::move(j.out);
    out[i].stopped = j.finish == "stop";
  }
  return out;
}

}  // namespace q3vl
