// The parameter table: the single source of every parameter's HF name, compute-layout shape, ZeRO unit, freezing
// part and weight-decay flag. Parameters of one unit are contiguous in one flat buffer (offsets recorded here);
// the model reads weights only through (unit, offset).
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "q3vl/model/config.hpp"

namespace q3vl {

// Freezing groups (spec 9): deepstack mergers belong to vision, the main merger to merger, the rest of text to llm.
// Lora: the adapters (model/lora.hpp), the only trained part when lora.rank > 0.
enum class Part { Vision, Merger, LLM, Lora };
const char* part_name(Part p);

struct ParamInfo {
  std::string name;            // exact HF name, e.g. model.language_model.layers.3.self_attn.q_proj.weight
  std::vector<int64_t> shape;  // compute layout (MoE experts: gate_up [E,2Im,H], down [E,H,Im] = transformers-5)
  int64_t numel = 0;
  int unit = 0;                // ZeRO unit index
  int64_t offset = 0;          // element offset inside the unit's flat buffer (of the elements held)
  // Expert parallelism: this rank holds elements [held_begin, held_begin + held) of the row-major tensor (its
  // E/ep experts, contiguous since experts lead the shape); every other tensor is held whole (0, numel).
  int64_t held_begin = 0, held = 0;
  Part part = Part::LLM;
  bool no_decay = false;       // norms and biases
};

struct UnitInfo {
  std::string name;            // e.g. "visual.blocks.3", "language_model.layers.0", "head"
  int64_t numel = 0;           // elements this rank holds (the held parts of its parameters)
  int64_t offset = 0;          // offset of this unit in a single concatenated buffer (HostWeights' store)
  std::vector<int> params;     // ids, in layout order
  bool experts = false;        // a MoE layer's experts ("language_model.layers.3.mlp.experts"): split over EP ranks
};

// Expert parallelism (parallel.ep): `size` ranks split every MoE layer's experts, rank `rank` holding experts
// [rank*E/size, (rank+1)*E/size) whole. Every other parameter is held whole by every rank.
struct ExpertSplit {
  int size = 1, rank = 0;
};

// Layer-local parameter order (id = first + index). Table order within a layer is this order.
namespace vblk { enum { norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b, norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b, count }; }
namespace vmrg { enum { norm_w, norm_b, fc1_w, fc1_b, fc2_w, fc2_b, count }; }
namespace vemb { enum { patch_w, patch_b, pos, count }; }
// Decoder layer: attention part, then either the dense MLP (gate, up adjacent so [gate;up] is one [2I,H] matrix)
// or the MoE block (router, experts).
namespace tlay {
enum { in_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_norm, mlp0, mlp1, mlp2, count };
enum { gate_proj = mlp0, up_proj = mlp1, down_proj = mlp2 };        // dense
enum { router = mlp0, experts_gate_up = mlp1, experts_down = mlp2 };  // MoE
}  // namespace tlay

class ParamTable {
 public:
  explicit ParamTable(const ModelConfig& cfg, ExpertSplit ep = {});

  const ModelConfig& config() const { return cfg_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const std::vector<UnitInfo>& units() const { return units_; }
  const ParamInfo& param(int id) const { return params_.at(id); }
  int id(const std::string& name) const;    // error naming the tensor when absent
  int find(const std::string& name) const;  // -1 when absent
  int64_t total() const { return total_; }  // sum of all units (elements held)
  const ExpertSplit& ep() const { return ep_; }
  int experts_per_rank() const { return cfg_.text.num_experts / ep_.size; }

  // First parameter id of each group (see the layer-local enums above).
  int vision_embed() const { return vemb_; }
  int vision_block(int i) const { return vblk_.at(i); }
  int merger() const { return merger_; }
  int deepstack_merger(int j) const { return ds_.at(j); }
  int embed_tokens() const { return embed_; }
  int layer(int l) const { return layer_.at(l); }
  int final_norm() const { return norm_; }
  int lm_head() const { return head_; }      // == embed_tokens() when tied
  bool moe_layer(int l) const { return moe_.at(l); }
  // LoRA: the lora_A id of a base weight's adapter (lora_B is the next id), -1 when it has none; the base weight
  // an adapter parameter wraps (-1 for base parameters).
  int lora_a(int id) const { return lora_a_.empty() ? -1 : lora_a_[size_t(id)]; }
  int lora_base(int id) const { return lora_base_.empty() ? -1 : lora_base_[size_t(id)]; }
  int experts(int l) const { return experts_.at(l); }  // first param of layer l's experts unit (-1: dense layer)

 private:
  int add(const std::string& name, std::vector<int64_t> shape, Part part, bool no_decay = false);
  void begin_unit(const std::string& name);
  void add_lora();  // adapters for the current unit's targeted linears, at its end

  ModelConfig cfg_;
  std::vector<ParamInfo> params_;
  std::vector<UnitInfo> units_;
  std::unordered_map<std::string, int> by_name_;
  int64_t total_ = 0;
  int vemb_ = -1, merger_ = -1, embed_ = -1, norm_ = -1, head_ = -1;
  ExpertSplit ep_;
  std::vector<int> vblk_, ds_, layer_, experts_;
  std::vector<bool> moe_;
  std::vector<int> lora_a_, lora_base_;
  std::vector<bool> lora_hit_;  // per target pattern: matched something
};

// The units' uses of one pass over a batch with images, in order (backward: the backward pass's): every model's
// forward and backward call their unit hooks (hooks.hpp) in a subsequence of it (no images: no vision units), the
// same on every rank. ZeRO-3 walks it to keep every rank's gathers and reduce-scatters matched. head_in_forward =
// false: a training forward that leaves the final norm and the LM head to the backward (set_loss_in_backward).
std::vector<int> unit_order(const ParamTable& t, bool backward, bool head_in_forward = true);

}  // namespace q3vl
