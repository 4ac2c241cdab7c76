// HF safetensors into the model through the parameter table (src/io/hf_weights.cpp): the io/ side of the model's
// weights, so that model/ knows no file format.
#pragma once
#include <string>
#include <vector>

#include "q3vl/model/qwen3vl.hpp"

namespace q3vl {

// Load HF safetensors (one file or a directory) into the model through the parameter table (src/model/weights.cpp).
// Every table tensor must be present with the right shape; unexpected tensors are errors; lm_head.weight is
// absent when tied. MoE experts are read in the released [E,H,2Im]/[E,Im,H] or the transformers-5
// [E,2Im,H]/[E,H,Im] layout as cfg.experts_v5_layout says, and checked against it.
void load_hf_weights(Model& m, const std::string& dir);
// load_hf_weights for slices only: the same checks (every tensor present with its shape, none unexpected), then
// only the slices' bytes are read (released-layout MoE experts: each expert a slice touches, whole).
SliceBytes load_hf_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices);
// LoRA (model/lora.hpp): the adapters of a PEFT folder (DIR/adapter_model.safetensors, tensors under PEFT's names)
// for slices of the table's adapter parameters (every adapter present with its shape, nothing else), and for a
// whole model.
SliceBytes load_lora_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices);
void load_lora_adapter(Model& m, const std::string& dir);

}  // namespace q3vl
