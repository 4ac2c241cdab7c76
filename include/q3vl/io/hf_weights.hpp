// HF safetensors into the model through the parameter table (src/io/hf_weights.cpp): the io/ side of the model's
// weights, so that model/ knows no file format.
#pragma once
#include <string>
#include <vector>

#include "q3vl/model/weights.hpp"

namespace q3vl {

// Load HF safetensors (one file or a directory) into the model through the parameter table (src/model/weights.cpp).
// Every table tensor must be present with the right shape; unexpected tensors are errors; lm_head.weight is
// absent when tied. MoE experts are read in the released [E,H,2Im]/[E,Im,H] or the transformers-5
// [E,2Im,H]/[E,H,Im] layout as cfg.experts_v5_layout says, and checked against it.
void load_hf_weights(HostWeights& m, const std::string& dir);
// load_hf_weights for slices only: the same checks (every tensor present with its shape, none unexpected), then
// only the slices' bytes are read (released-layout MoE experts: each expert a slice touches, whole).
SliceBytes load_hf_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices);
// LoRA (model/lora.hpp): a PEFT folder (DIR/adapter_model.safetensors, tensors under PEFT's names) read into
// slices of any parameters, after the base (load_hf_weights/load_hf_slices/init): every adapter must be present with
// its shape; the base weights PEFT saves beside the adapters replace the base's, as PEFT's load_state_dict does (a
// wrapped layer's "base_model.model.<module>.base_layer.weight", e.g. lm_head or embed_tokens in target_modules;
// "base_model.model.<module>.weight" for save_embedding_layers or modules_to_save), each with the base's on-disk
// shape; a tied head is the embedding, so its lm_head weights replace the embeddings too (PEFT's tied lm_head
// shares the embedding's storage; of both, lm_head's wins, loaded last as in PEFT); anything else is refused
// naming file and tensor. Slices of base parameters the file does not hold are left as they are.
SliceBytes load_lora_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices);
// The same for a whole model.
void load_lora_adapter(HostWeights& m, const std::string& dir);

}  // namespace q3vl
