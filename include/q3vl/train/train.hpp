// `q3vl train DECK`: ZeRO data-parallel training (parallel/zero.hpp) of a Qwen3-VL model with AdamW, the
// distributed loader (train/loader.hpp), HDF5 checkpoints that any rank count resumes, and metrics.jsonl.
#pragma once
#include "q3vl/core/deck.hpp"

namespace q3vl {

int run_train(const Deck& deck);

}  // namespace q3vl
