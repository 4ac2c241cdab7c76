// Parameter table: built once from the config, in the order the model runs (vision, mergers, text, head).
#include "q3vl/model/params.hpp"

#include <algorithm>

#include "q3vl/core/error.hpp"
#include "q3vl/model/lora.hpp"

namespace q3vl {

static std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

const char* part_name(Part p) {
  switch (p) {
    case Part::Vision: return "vision";
    case Part::Merger: return "merger";
    case Part::LLM: return "llm";
    case Part::Lora: return "lora";
  }
  return "?";
}

// Adapters go at the end of the unit of the linear they wrap, so that base offsets are the same with and without
// them (gate_proj/up_proj stay adjacent) and ZeRO gathers them with their base weight. The LM head's (module
// "lm_head", as PEFT names it) goes in the head unit even when the head is the embedding: only the output
// projection is adapted, and the embedding unit stays as it was.
void ParamTable::add_lora() {
  const LoraConfig& lc = cfg_.lora;
  if (!lc.on() || units_.empty()) return;
  lora_hit_.resize(lc.targets.size());
  auto wrap = [&](int id, const std::string& module) {
    bool hit = false;
    for (size_t k = 0; k < lc.targets.size(); ++k)
      if (lora_pattern_match(lc.targets[k], module)) hit = lora_hit_[k] = true;
    if (!hit) return;
    const int64_t out = params_[size_t(id)].shape[0], in = params_[size_t(id)].shape[1];
    const int a = add(module + ".lora_A.weight", {lc.rank, in}, Part::Lora);
    add(module + ".lora_B.weight", {out, lc.rank}, Part::Lora);
    lora_a_.resize(params_.size(), -1);
    lora_base_.resize(params_.size(), -1);
    lora_a_[size_t(id)] = a;
    lora_base_[size_t(a)] = lora_base_[size_t(a) + 1] = id;
  };
  const std::vector<int> base = units_.back().params;
  for (int id : base) {
    const std::string name = params_[size_t(id)].name;
    if (lora_eligible(name)) wrap(id, name.substr(0, name.size() - 7));  // module: without ".weight"
  }
  if (units_.back().name == "head" && head_ >= 0) wrap(head_, "lm_head");
}

void ParamTable::begin_unit(const std::string& name) {
  add_lora();
  UnitInfo u;
  u.name = name;
  u.offset = total_;
  units_.push_back(u);
}

int ParamTable::add(const std::string& name, std::vector<int64_t> shape, Part part, bool no_decay) {
  ParamInfo p;
  p.name = name;
  p.numel = 1;
  for (auto s : shape) {
    if (s <= 0) fail("parameter " + name + ": non-positive dimension in its shape (check the config)");
    p.numel *= s;
  }
  p.shape = std::move(shape);
  p.part = part;
  p.no_decay = no_decay;
  UnitInfo& u = units_.back();
  p.unit = (int)units_.size() - 1;
  p.offset = u.numel;
  p.held = u.experts ? p.numel / ep_.size : p.numel;  // the caller checked that E divides
  p.held_begin = u.experts ? ep_.rank * p.held : 0;
  u.numel += p.held;
  total_ += p.held;
  const int id = (int)params_.size();
  u.params.push_back(id);
  by_name_[name] = id;
  params_.push_back(std::move(p));
  return id;
}

ParamTable::ParamTable(const ModelConfig& cfg, ExpertSplit ep) : cfg_(cfg), ep_(ep) {
  const VisionConfig& v = cfg.vision;
  const TextConfig& t = cfg.text;
  const int64_t Dv = v.hidden, Iv = v.intermediate, Dm = 4 * Dv, Dout = v.out_hidden;
  if (v.merge != 2) fail("vision.spatial_merge_size must be 2 (got " + std::to_string(v.merge) + ")");
  if (Dv % v.heads) fail("vision hidden size not divisible by vision heads");
  if (Dout != t.hidden) fail("vision out_hidden_size must equal the text hidden size");
  const std::string vp = "model.visual.", tp = "model.language_model.";

  begin_unit("visual.embed");
  vemb_ = add(vp + "patch_embed.proj.weight", {Dv, v.in_channels, v.temporal_patch, v.patch, v.patch}, Part::Vision);
  add(vp + "patch_embed.proj.bias", {Dv}, Part::Vision, true);
  add(vp + "pos_embed.weight", {v.num_position_embeddings, Dv}, Part::Vision);

  for (int i = 0; i < v.depth; ++i) {
    const std::string b = vp + "blocks." + std::to_string(i) + ".";
    begin_unit("visual.blocks." + std::to_string(i));
    vblk_.push_back(add(b + "norm1.weight", {Dv}, Part::Vision, true));
    add(b + "norm1.bias", {Dv}, Part::Vision, true);
    add(b + "attn.qkv.weight", {3 * Dv, Dv}, Part::Vision);
    add(b + "attn.qkv.bias", {3 * Dv}, Part::Vision, true);
    add(b + "attn.proj.weight", {Dv, Dv}, Part::Vision);
    add(b + "attn.proj.bias", {Dv}, Part::Vision, true);
    add(b + "norm2.weight", {Dv}, Part::Vision, true);
    add(b + "norm2.bias", {Dv}, Part::Vision, true);
    add(b + "mlp.linear_fc1.weight", {Iv, Dv}, Part::Vision);
    add(b + "mlp.linear_fc1.bias", {Iv}, Part::Vision, true);
    add(b + "mlp.linear_fc2.weight", {Dv, Iv}, Part::Vision);
    add(b + "mlp.linear_fc2.bias", {Dv}, Part::Vision, true);
  }

  begin_unit("visual.mergers");
  auto merger = [&](const std::string& b, int64_t norm_dim, Part part) {
    int first = add(b + "norm.weight", {norm_dim}, part, true);
    add(b + "norm.bias", {norm_dim}, part, true);
    add(b + "linear_fc1.weight", {Dm, Dm}, part);
    add(b + "linear_fc1.bias", {Dm}, part, true);
    add(b + "linear_fc2.weight", {Dout, Dm}, part);
    add(b + "linear_fc2.bias", {Dout}, part, true);
    return first;
  };
  merger_ = merger(vp + "merger.", Dv, Part::Merger);
  for (size_t j = 0; j < v.deepstack_indexes.size(); ++j) {
    const int bi = v.deepstack_indexes[j];
    if (bi < 0 || bi >= v.depth) fail("deepstack_visual_indexes entry " + std::to_string(bi) + " outside the ViT depth");
    ds_.push_back(merger(vp + "deepstack_merger_list." + std::to_string(j) + ".", Dm, Part::Vision));
  }
  if ((int)v.deepstack_indexes.size() > t.layers) fail("more deepstack mergers than decoder layers");

  const int64_t H = t.hidden, hd = t.head_dim;
  if (t.kv_heads <= 0 || t.heads % t.kv_heads) fail("text heads must be a multiple of kv heads");
  if (hd % 2 || 2 * (t.mrope_section[0] + t.mrope_section[1] + t.mrope_section[2]) != hd)
    fail("mrope_section must sum to head_dim/2 (head_dim " + std::to_string(hd) + ")");
  begin_unit("language_model.embed_tokens");
  embed_ = add(tp + "embed_tokens.weight", {t.vocab, H}, Part::LLM);

  for (int l = 0; l < t.layers; ++l) {
    const std::string b = tp + "layers." + std::to_string(l) + ".";
    begin_unit("language_model.layers." + std::to_string(l));
    layer_.push_back(add(b + "input_layernorm.weight", {H}, Part::LLM, true));
    add(b + "self_attn.q_proj.weight", {t.heads * hd, H}, Part::LLM);
    add(b + "self_attn.k_proj.weight", {t.kv_heads * hd, H}, Part::LLM);
    add(b + "self_attn.v_proj.weight", {t.kv_heads * hd, H}, Part::LLM);
    add(b + "self_attn.o_proj.weight", {H, t.heads * hd}, Part::LLM);
    add(b + "self_attn.q_norm.weight", {hd}, Part::LLM, true);
    add(b + "self_attn.k_norm.weight", {hd}, Part::LLM, true);
    add(b + "post_attention_layernorm.weight", {H}, Part::LLM, true);
    const bool moe = cfg.is_moe_layer(l);
    moe_.push_back(moe);
    if (moe) {
      const int64_t E = t.num_experts, Im = t.moe_intermediate;
      if (t.experts_per_tok <= 0 || t.experts_per_tok > E) fail("num_experts_per_tok must be in [1, num_experts]");
      if (ep.size < 1 || ep.rank < 0 || ep.rank >= ep.size || E % ep.size)
        fail("expert parallelism: " + std::to_string(ep.size) + " ranks cannot split " + std::to_string(E) +
             " experts evenly (parallel.ep must divide num_experts)");
      add(b + "mlp.gate.weight", {E, H}, Part::LLM);
      // The experts are a unit of their own: expert parallelism splits them, ZeRO shards them over other ranks.
      begin_unit("language_model.layers." + std::to_string(l) + ".mlp.experts");
      units_.back().experts = true;
      experts_.push_back(add(b + "mlp.experts.gate_up_proj", {E, 2 * Im, H}, Part::LLM));
      add(b + "mlp.experts.down_proj", {E, H, Im}, Part::LLM);
    } else {
      experts_.push_back(-1);
      add(b + "mlp.gate_proj.weight", {t.intermediate, H}, Part::LLM);
      add(b + "mlp.up_proj.weight", {t.intermediate, H}, Part::LLM);
      add(b + "mlp.down_proj.weight", {H, t.intermediate}, Part::LLM);
    }
  }

  begin_unit("head");
  norm_ = add(tp + "norm.weight", {H}, Part::LLM, true);
  head_ = t.tie_embeddings ? embed_ : add("lm_head.weight", {t.vocab, H}, Part::LLM);
  add_lora();
  if (cfg.lora.on()) {
    lora_a_.resize(params_.size(), -1);
    lora_base_.resize(params_.size(), -1);
    // A standard module name this architecture lacks (gate_proj on an all-MoE model, mlp.gate on a dense one) is
    // fine, so that one target list serves both; anything else that wraps nothing is a typo.
    if (std::all_of(lora_a_.begin(), lora_a_.end(), [](int a) { return a < 0; }))
      fail("lora.targets: no linear of this model matches '" + join(cfg.lora.targets) + "'");
    for (size_t k = 0; k < cfg.lora.targets.size(); ++k)
      if (!lora_hit_[k] && !lora_standard_module(cfg.lora.targets[k]))
        fail("lora.targets: pattern '" + cfg.lora.targets[k] +
             "' matches no linear of this model (eligible: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
             "down_proj, mlp.gate, attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2, merger.linear_fc1, "
             "merger.linear_fc2, lm_head, or a glob such as 'layers.*.self_attn.q_proj')");
  }
}

int ParamTable::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

int ParamTable::id(const std::string& name) const {
  int i = find(name);
  if (i < 0) fail("parameter table: no tensor named " + name);
  return i;
}

std::vector<int> unit_order(const ParamTable& t, bool backward, bool head_in_forward) {
  const VisionConfig& vc = t.config().vision;
  const int layers = t.config().text.layers;
  std::vector<int> o;
  auto use = [&](int id) { o.push_back(t.params()[id].unit); };
  auto layer = [&](int l) {
    use(t.layer(l));
    if (t.experts(l) >= 0) use(t.experts(l));
  };
  const int head = t.params()[t.final_norm()].unit, lm = t.params()[t.lm_head()].unit;
  if (!backward) {
    use(t.vision_embed());
    for (int i = 0; i < vc.depth; ++i) {
      use(t.vision_block(i));
      for (size_t j = 0; j < vc.deepstack_indexes.size(); ++j)
        if (vc.deepstack_indexes[j] == i) use(t.deepstack_merger(j));
    }
    use(t.merger());
    use(t.embed_tokens());
    for (int l = 0; l < layers; ++l) layer(l);
    if (!head_in_forward) return o;
    use(t.final_norm());
    if (lm != head) use(t.lm_head());
    return o;
  }
  use(t.final_norm());
  if (lm != head) use(t.lm_head());
  for (int l = layers - 1; l >= 0; --l) layer(l);
  use(t.embed_tokens());
  use(t.merger());
  for (int i = vc.depth - 1; i >= 0; --i) {
    for (size_t j = 0; j < vc.deepstack_indexes.size(); ++j)
      if (vc.deepstack_indexes[j] == i && j < (size_t)layers) use(t.deepstack_merger(j));
    use(t.vision_block(i));
  }
  use(t.vision_embed());
  return o;
}

}  // namespace q3vl
