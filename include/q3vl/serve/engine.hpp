// The engine (as vLLM's LLMEngine): the block manager, the model runner and the scheduler, for `q3vl serve` (the HTTP
// threads' requests as jobs) and `q3vl generate` (a prompts file as jobs, offline, as vLLM's LLM.generate): one
// batching loop for both. Rank 0 runs the scheduler; the other ranks follow its steps (Runner::follow) in the layout
// of serve.tp x serve.pp.
#pragma once
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/serve/block_manager.hpp"
#include "q3vl/serve/generate.hpp"
#include "q3vl/serve/runner.hpp"
#include "q3vl/serve/scheduler.hpp"

namespace q3vl {

// generate's engine: generate.batch sequences at once, prefix cache off, and the step buffers and KV pool of a run of
// fixed batches of generate.batch prompts in file order, each prompt with room for max_new tokens: a step of a
// batch's prompts together, the vision pass of the prompt with the most patches, the KV blocks of the batch that needs
// the most (a sequence waits for blocks, so the engine runs in that much whatever it admits together).
EngineConfig generate_config(const Deck& d, const ModelConfig& cfg, const std::vector<GenPrompt>& prompts,
                             int64_t max_new);

class Engine {
 public:
  Engine(const Deck& d, const EngineConfig& c) : config(c), runner(d, config, blocks) {}
  // The model on every rank (collective), blocks reset to its pools.
  void load();
  // Offline, on rank 0 (configure the scheduler first): the answers to prompts, in their order; prompt i samples
  // from the stream seeded by (sp.seed, first_index + i), so that answers do not depend on what runs beside it.
  std::vector<GenResult> generate(std::vector<GenPrompt> prompts, const SamplingParams& sp, size_t first_index = 0);

  const EngineConfig config;
  BlockManager blocks;  // the KV cache's bookkeeping: rank 0 decides, the other ranks replay its log
  Runner runner;
  Metrics metrics;
  Scheduler scheduler{runner, blocks, metrics};  // rank 0's
};

}  // namespace q3vl
