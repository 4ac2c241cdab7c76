// `q3vl train DECK`: ZeRO data-parallel training (parallel/zero.hpp) of a Qwen3-VL model with AdamW, the
// distributed loader (train/loader.hpp), HDF5 checkpoints that any rank count resumes, and metrics.jsonl.
#pragma once
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/model/params.hpp"

namespace q3vl {

int run_train(const Deck& deck);
// The model, and the config.json text that checkpoints keep: model.hf's file unchanged, else model.preset's;
// cfg.lora from the deck's [lora].
ModelConfig model_config(const Deck& d, std::string* json_text);
// One flag per table parameter from train.tune_vision/_merger/_llm (the planner sizes the same set); with LoRA
// the adapters only.
std::vector<bool> trainable_flags(const ParamTable& t, const Deck& d);

}  // namespace q3vl
