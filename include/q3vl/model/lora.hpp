// LoRA (PEFT semantics): a targeted linear y = W x + b becomes y = W x + b + scale * B A dropout(x), with
// A [r, in] (kaiming-uniform, a = sqrt(5), as PEFT) and B [out, r] (zeros). The adapters are ordinary parameters of
// the table (Part::Lora), in the ZeRO unit of the linear they wrap, named like the base weight with ".weight"
// replaced by ".lora_A.weight" / ".lora_B.weight" (the LM head's: "lm_head.lora_A.weight", in the head unit, also
// when the head is the tied embedding); PEFT's names add "base_model.model." in front.
// Forward and backward are stateless (backward recomputes A dropout(x) from the linear's saved input and the
// counter-based dropout mask), so activation recomputation and any rank count see the same adapters. The device
// model's (model/dev_layers.hpp, dev_lora_*) and the test reference's host layers compute the same, masks included.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "q3vl/model/config.hpp"

namespace q3vl {

class Deck;
class ParamTable;

// [lora] of the deck; bad values are errors naming the key.
LoraConfig lora_config(const Deck& d);
// Does module name (HF name without ".weight") match one pattern (PEFT: equal, or ends with ".pattern"; '*' globs)?
bool lora_pattern_match(const std::string& pattern, const std::string& module);
// Linears LoRA may wrap: 2-D weights of q/k/v/o_proj, gate/up/down_proj, the MoE router, the vision blocks' and
// mergers' linears (not embeddings, patch embedding or 3-D expert tensors). The LM head is wrapped apart (module
// "lm_head", tied or not: ParamTable), as PEFT wraps the lm_head Linear; a tied embedding lookup stays unadapted.
bool lora_eligible(const std::string& hf_name);
// A pattern naming one of those module kinds (q_proj, mlp.gate, linear_fc1, ...): absent from some architectures
// (gate_proj on an all-MoE model), so matching nothing there is no error; any other pattern must match.
bool lora_standard_module(const std::string& pattern);
// The PEFT name of an adapter parameter of the table ("base_model.model." + name).
std::string peft_name(const std::string& table_name);

// Adapter sizing without allocating (for the planner): elements of all A and B matrices for cfg.lora.
struct LoraSize {
  int64_t wrapped = 0;   // linears wrapped
  int64_t params = 0;    // adapter elements (A + B)
  int64_t base = 0;      // base elements (frozen)
  // Trained state: fp32 masters + grads + two AdamW moments, per element.
  int64_t state_bytes() const { return params * 4 * 4; }
};
LoraSize lora_size(const ModelConfig& cfg);

// What the adapters need at run time (the device model's, and the test reference's host layers).
struct LoraRun {
  const ParamTable* table = nullptr;
  double scale = 0, dropout = 0;
  bool train = false;         // dropout only while training (PEFT in eval mode applies none)
  uint64_t seed = 0, nonce = 0;  // dropout mask = f(seed, nonce, parameter, element): set per micro-step
};

// The dropout mask's key of adapter `a` (its lora_A id) in the micro-step `nonce` of a run seeded `seed`; element
// (row, col) of an adapter's input [rows, in] draws at row * in + col (core/hash.hpp's dropout_drops).
uint64_t lora_dropout_key(uint64_t seed, uint64_t nonce, int a);

// Base weights with the adapters folded in (W += scale * B A) for every wrapped linear of a full-storage model
// (serve's tensor parallelism, and the merged-forward test). Returns the number of linears merged. A tied LM head's
// adapter folds into untied_head (the caller's copy of the embeddings, the head of an untied model); null: refused.
template <class T> int lora_merge(const ParamTable& t, double scale, T* const* params, T* untied_head = nullptr);
// Is adapter `a` (its lora_A id) the LM head's on a table whose head is the embedding?
bool lora_tied_head(const ParamTable& t, int a);

}  // namespace q3vl
