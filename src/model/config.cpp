#include "q3vl/model/config.hpp"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "q3vl/core/error.hpp"

namespace q3vl {
using json = nlohmann::json;

namespace {

const char* const kArchitectures[] = {"Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"};
const char* const kReleasedVersion = "4.57.0";  // the schema and expert layout of the released checkpoints

// Typed access to one JSON object of config.json; `prefix` is the object's path ("text_config.") for messages.
struct Reader {
  const std::string& file;
  const json& obj;
  std::string prefix;

  bool has(const std::string& key) const { return obj.is_object() && obj.contains(key) && !obj[key].is_null(); }
  [[noreturn]] void missing(const std::string& key) const {
    fail("config: '" + file + "': required key '" + prefix + key + "' is missing");
  }
  [[noreturn]] void wrong(const std::string& key, const char* what) const {
    fail("config: '" + file + "': key '" + prefix + key + "' must be " + what + ", got " + obj[key].dump());
  }
  const json& at(const std::string& key) const {
    if (!has(key)) missing(key);
    return obj[key];
  }
  int integer(const std::string& key) const {
    const json& v = at(key);
    // Some writers store integral values as floats (e.g. 5000000.0); accept those, refuse fractions.
    if (v.is_number_integer()) return v.get<int>();
    if (v.is_number_float() && v.get<double>() == static_cast<double>(static_cast<int64_t>(v.get<double>())))
      return static_cast<int>(v.get<double>());
    wrong(key, "an integer");
  }
  int integer(const std::string& key, int def) const { return has(key) ? integer(key) : def; }
  double number(const std::string& key) const {
    const json& v = at(key);
    if (!v.is_number()) wrong(key, "a number");
    return v.get<double>();
  }
  double number(const std::string& key, double def) const { return has(key) ? number(key) : def; }
  bool boolean(const std::string& key, bool def) const {
    if (!has(key)) return def;
    if (!obj[key].is_boolean()) wrong(key, "true or false");
    return obj[key].get<bool>();
  }
  std::string string(const std::string& key) const {
    if (!at(key).is_string()) wrong(key, "a string");
    return obj[key].get<std::string>();
  }
  std::vector<int> int_list(const std::string& key) const {
    const json& v = at(key);
    if (!v.is_array()) wrong(key, "a list of integers");
    std::vector<int> r;
    for (auto& x : v) {
      if (!x.is_number_integer()) wrong(key, "a list of integers");
      r.push_back(x.get<int>());
    }
    return r;
  }
  Reader sub(const std::string& key) const {
    if (!at(key).is_object()) wrong(key, "an object");
    return Reader{file, obj[key], prefix + key + "."};
  }
};

// A token id that may sit at the top level (the usual place) or in text_config; eos may be a list.
int token_id(const Reader& top, const Reader& text, const std::string& key, int def) {
  for (const Reader* r : {&top, &text}) {
    if (!r->has(key)) continue;
    const json& v = r->obj[key];
    if (v.is_array() && !v.empty() && v[0].is_number_integer()) return v[0].get<int>();
    return r->integer(key);
  }
  return def;
}

// Rope settings: 4.57 has text_config.rope_theta + text_config.rope_scaling.mrope_section; 5.x has
// text_config.rope_parameters {rope_theta, mrope_section, ...}, possibly keyed by layer type
// ({"full_attention": {...}}), and possibly at the top level.
void read_rope(const Reader& top, const Reader& text, TextConfig& t) {
  const Reader* holder = text.has("rope_parameters") ? &text : top.has("rope_parameters") ? &top : nullptr;
  std::vector<int> section;
  if (holder) {
    const Reader outer = holder->sub("rope_parameters");
    // Keyed by layer type: take the single entry (Qwen3-VL has one attention type).
    const bool keyed = !outer.has("rope_theta") && outer.obj.size() == 1 && outer.obj.begin().value().is_object();
    const Reader rp = keyed ? outer.sub(outer.obj.begin().key()) : outer;
    t.rope_theta = rp.number("rope_theta");
    section = rp.int_list("mrope_section");
    if (section.size() != 3)
      fail("config: '" + top.file + "': key '" + rp.prefix + "mrope_section' must have 3 entries (T,H,W)");
  } else {
    t.rope_theta = text.number("rope_theta");
    Reader rs = text.sub("rope_scaling");
    section = rs.int_list("mrope_section");
    if (section.size() != 3)
      fail("config: '" + top.file + "': key '" + rs.prefix + "mrope_section' must have 3 entries (T,H,W)");
  }
  t.mrope_section = {section[0], section[1], section[2]};
}

int version_major(const std::string& v) {
  size_t i = 0;
  int major = 0;
  while (i < v.size() && v[i] >= '0' && v[i] <= '9') major = major * 10 + (v[i++] - '0');
  return major;
}

// Cross-field checks that catch a config the model code could not run.
void validate(const ModelConfig& c, const std::string& where) {
  auto bad = [&](const std::string& what) { fail("config: '" + where + "': " + what); };
  const TextConfig& t = c.text;
  const VisionConfig& v = c.vision;
  for (int x : {t.vocab, t.hidden, t.layers, t.heads, t.kv_heads, t.head_dim, v.depth, v.hidden, v.intermediate,
                v.heads, v.out_hidden, v.patch, v.temporal_patch, v.merge, v.in_channels, v.num_position_embeddings})
    if (x <= 0) bad("every dimension must be positive");
  if (t.heads % t.kv_heads != 0)
    bad("num_attention_heads (" + std::to_string(t.heads) + ") must be a multiple of num_key_value_heads (" +
        std::to_string(t.kv_heads) + ")");
  if (t.head_dim % 2 || t.mrope_section[0] + t.mrope_section[1] + t.mrope_section[2] != t.head_dim / 2)
    bad("mrope_section must sum to head_dim/2 = " + std::to_string(t.head_dim / 2));
  if (v.hidden % v.heads != 0) bad("vision hidden_size must be a multiple of vision num_heads");
  for (int i : v.deepstack_indexes)
    if (i < 0 || i >= v.depth) bad("deepstack_visual_indexes entry " + std::to_string(i) + " is outside [0, depth)");
  if (static_cast<int>(v.deepstack_indexes.size()) > t.layers) bad("more deepstack indexes than decoder layers");
  if (c.moe()) {
    if (t.experts_per_tok <= 0 || t.experts_per_tok > t.num_experts)
      bad("num_experts_per_tok must be in [1, num_experts]");
    if (t.moe_intermediate <= 0 || t.decoder_sparse_step <= 0)
      bad("moe_intermediate_size and decoder_sparse_step must be positive");
  } else if (t.intermediate <= 0) {
    bad("intermediate_size must be positive");
  }
  for (int id : {c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id})
    if (id < 0 || id >= t.vocab) bad("special token id " + std::to_string(id) + " is outside the vocabulary");
}

}  // namespace

bool ModelConfig::is_moe_layer(int l) const {
  if (!moe()) return false;
  if (std::find(text.mlp_only_layers.begin(), text.mlp_only_layers.end(), l) != text.mlp_only_layers.end())
    return false;
  return (l + 1) % text.decoder_sparse_step == 0;
}

ModelConfig load_hf_config(const std::string& path, std::string* text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("config: cannot open '" + path + "'");
  std::string s((std::istreambuf_iterator<char>(in)), {});
  ModelConfig c = parse_hf_config(s, path);
  if (text) *text = std::move(s);
  return c;
}

ModelConfig parse_hf_config(const std::string& json_text, const std::string& path) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail("config: '" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object()) fail("config: '" + path + "' is not a JSON object");
  const Reader top{path, j, ""};
  ModelConfig c;

  const json& archs = top.at("architectures");
  if (!archs.is_array() || archs.empty() || !archs[0].is_string()) top.wrong("architectures", "a list of names");
  c.architecture = archs[0].get<std::string>();
  if (std::find(std::begin(kArchitectures), std::end(kArchitectures), c.architecture) == std::end(kArchitectures))
    fail("config: '" + path + "': unknown architecture '" + c.architecture +
         "' (known: Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration)");
  const bool moe = c.architecture == "Qwen3VLMoeForConditionalGeneration";
  if (top.has("transformers_version")) c.transformers_version = top.string("transformers_version");
  c.experts_v5_layout = version_major(c.transformers_version) >= 5;

  const Reader text = top.sub("text_config");
  TextConfig& t = c.text;
  t.vocab = text.integer("vocab_size");
  t.hidden = text.integer("hidden_size");
  t.layers = text.integer("num_hidden_layers");
  t.heads = text.integer("num_attention_heads");
  t.kv_heads = text.integer("num_key_value_heads");
  t.head_dim = text.integer("head_dim");
  t.rms_eps = text.number("rms_norm_eps", 1e-6);
  read_rope(top, text, t);
  // The top-level flag is what the composite model ties on; text_config's copy is only a fallback.
  t.tie_embeddings = top.has("tie_word_embeddings") ? top.boolean("tie_word_embeddings", false)
                                                    : text.boolean("tie_word_embeddings", false);
  if (moe) {
    t.intermediate = text.integer("intermediate_size", 0);  // unused by MoE layers
    t.num_experts = text.has("num_experts") ? text.integer("num_experts") : text.integer("num_local_experts");
    t.experts_per_tok = text.integer("num_experts_per_tok");
    t.moe_intermediate = text.integer("moe_intermediate_size");
    t.decoder_sparse_step = text.integer("decoder_sparse_step", 1);
    t.mlp_only_layers = text.has("mlp_only_layers") ? text.int_list("mlp_only_layers") : std::vector<int>{};
    t.router_aux_loss_coef = text.number("router_aux_loss_coef", 0.001);
    if (t.num_experts <= 0) fail("config: '" + path + "': key 'text_config.num_experts' must be positive for " + c.architecture);
  } else {
    t.intermediate = text.integer("intermediate_size");
  }

  const Reader vis = top.sub("vision_config");
  VisionConfig& v = c.vision;
  v.depth = vis.integer("depth");
  v.hidden = vis.integer("hidden_size");
  v.intermediate = vis.integer("intermediate_size");
  v.heads = vis.integer("num_heads");
  v.out_hidden = vis.integer("out_hidden_size");
  v.deepstack_indexes = vis.int_list("deepstack_visual_indexes");
  v.patch = vis.integer("patch_size", 16);
  v.temporal_patch = vis.integer("temporal_patch_size", 2);
  v.merge = vis.integer("spatial_merge_size", 2);
  v.in_channels = vis.integer("in_channels", 3);
  v.num_position_embeddings = vis.integer("num_position_embeddings", 2304);
  if (v.out_hidden != t.hidden)
    fail("config: '" + path + "': vision_config.out_hidden_size (" + std::to_string(v.out_hidden) +
         ") must equal text_config.hidden_size (" + std::to_string(t.hidden) + ")");

  c.image_token_id = token_id(top, text, "image_token_id", c.image_token_id);
  c.video_token_id = token_id(top, text, "video_token_id", c.video_token_id);
  c.vision_start_token_id = token_id(top, text, "vision_start_token_id", c.vision_start_token_id);
  c.vision_end_token_id = token_id(top, text, "vision_end_token_id", c.vision_end_token_id);
  c.eos_token_id = token_id(top, text, "eos_token_id", c.eos_token_id);
  c.pad_token_id = token_id(top, text, "pad_token_id", c.pad_token_id);
  validate(c, path);
  return c;
}

// First path at which a and b differ, "" if none.
static std::string json_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& at) {
  if (a.is_object() && b.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string key = at.empty() ? it.key() : at + "." + it.key();
      if (!b.contains(it.key())) return key + ": " + it.value().dump() + " in the checkpoint, absent here";
      if (std::string d = json_difference(it.value(), b[it.key()], key); !d.empty()) return d;
    }
    for (auto it = b.begin(); it != b.end(); ++it)
      if (!a.contains(it.key()))
        return (at.empty() ? it.key() : at + "." + it.key()) + ": absent in the checkpoint, " + it.value().dump() + " here";
    return "";
  }
  return a == b ? "" : at + ": " + a.dump() + " in the checkpoint, " + b.dump() + " here";
}

std::string config_difference(const ModelConfig& checkpoint, const ModelConfig& here) {
  auto canonical = [](const ModelConfig& c) {
    nlohmann::json j = nlohmann::json::parse(hf_config_json(c));
    j.erase("transformers_version");  // the experts' layout on disk, not what the model computes
    j.erase("dtype");
    return j;
  };
  return json_difference(canonical(checkpoint), canonical(here), "");
}

std::string hf_config_json(const ModelConfig& c) {
  const TextConfig& t = c.text;
  const VisionConfig& v = c.vision;
  const bool moe = c.moe();
  const std::string type = moe ? "qwen3_vl_moe" : "qwen3_vl";
  // The version string is what tells a reader the expert layout on disk: keep c's unless it disagrees.
  std::string version = c.transformers_version;
  if (version.empty() || (version_major(version) >= 5) != c.experts_v5_layout)
    version = c.experts_v5_layout ? "5.0.0" : kReleasedVersion;
  // Keys q3vl does not model (dropout, max positions, activations...) take the released checkpoints' values;
  // dtype is what checkpoints hold (fp32 master weights).
  json text = {{"attention_bias", false}, {"attention_dropout", 0.0},
               {"bos_token_id", c.pad_token_id},  // Qwen's <|endoftext|> is both bos and pad
               {"dtype", "float32"}, {"eos_token_id", c.eos_token_id}, {"head_dim", t.head_dim},
               {"hidden_act", "silu"}, {"hidden_size", t.hidden}, {"initializer_range", 0.02},
               {"intermediate_size", t.intermediate}, {"max_position_embeddings", 262144},
               {"model_type", type + "_text"}, {"num_attention_heads", t.heads}, {"num_hidden_layers", t.layers},
               {"num_key_value_heads", t.kv_heads}, {"pad_token_id", c.pad_token_id}, {"rms_norm_eps", t.rms_eps},
               {"rope_scaling", {{"mrope_interleaved", true}, {"mrope_section", t.mrope_section},
                                 {"rope_type", "default"}}},
               {"rope_theta", t.rope_theta}, {"tie_word_embeddings", t.tie_embeddings}, {"use_cache", true},
               {"vocab_size", t.vocab}};
  if (moe)
    text.update({{"decoder_sparse_step", t.decoder_sparse_step}, {"mlp_only_layers", t.mlp_only_layers},
                 {"moe_intermediate_size", t.moe_intermediate}, {"norm_topk_prob", true},
                 {"num_experts", t.num_experts}, {"num_experts_per_tok", t.experts_per_tok},
                 {"router_aux_loss_coef", t.router_aux_loss_coef}});
  const json vision = {
      {"deepstack_visual_indexes", v.deepstack_indexes}, {"depth", v.depth}, {"hidden_act", "gelu_pytorch_tanh"},
      {"hidden_size", v.hidden}, {"in_channels", v.in_channels}, {"initializer_range", 0.02},
      {"intermediate_size", v.intermediate}, {"model_type", type}, {"num_heads", v.heads},
      {"num_position_embeddings", v.num_position_embeddings}, {"out_hidden_size", v.out_hidden},
      {"patch_size", v.patch}, {"spatial_merge_size", v.merge}, {"temporal_patch_size", v.temporal_patch}};
  const json j = {{"architectures", json::array({c.architecture})}, {"dtype", "float32"},
                  {"image_token_id", c.image_token_id}, {"model_type", type}, {"text_config", text},
                  {"tie_word_embeddings", t.tie_embeddings}, {"transformers_version", version},
                  {"video_token_id", c.video_token_id}, {"vision_config", vision},
                  {"vision_end_token_id", c.vision_end_token_id}, {"vision_start_token_id", c.vision_start_token_id}};
  return j.dump(2) + "\n";
}

std::vector<std::string> preset_names() { return {"2B", "4B", "8B", "32B", "30B-A3B", "235B-A22B", "tiny", "tiny-moe", "demo"}; }

ModelConfig preset_config(const std::string& name) {
  ModelConfig c;
  VisionConfig& v = c.vision;
  TextConfig& t = c.text;
  // Spec section 7. Released configs: 4.57 schema, experts on disk as [E,H,2Im]/[E,Im,H].
  auto vision = [&](int depth, int hidden, int inter, int out, std::vector<int> ds) {
    v.depth = depth, v.hidden = hidden, v.intermediate = inter, v.out_hidden = out, v.deepstack_indexes = ds;
  };
  auto text = [&](int hidden, int inter, int layers, int heads, int kv, bool tie) {
    t.hidden = hidden, t.intermediate = inter, t.layers = layers, t.heads = heads, t.kv_heads = kv;
    t.tie_embeddings = tie;
  };
  auto experts = [&](int e, int k, int im) {
    c.architecture = "Qwen3VLMoeForConditionalGeneration";
    t.num_experts = e, t.experts_per_tok = k, t.moe_intermediate = im;
  };
  c.architecture = "Qwen3VLForConditionalGeneration";
  c.transformers_version = kReleasedVersion;
  if (name == "2B") {
    vision(24, 1024, 4096, 2048, {5, 11, 17}), text(2048, 6144, 28, 16, 8, true);
  } else if (name == "4B") {
    vision(24, 1024, 4096, 2560, {5, 11, 17}), text(2560, 9728, 36, 32, 8, true);
  } else if (name == "8B") {
    vision(27, 1152, 4304, 4096, {8, 16, 24}), text(4096, 12288, 36, 32, 8, false);
  } else if (name == "32B") {
    vision(27, 1152, 4304, 5120, {8, 16, 24}), text(5120, 25600, 64, 64, 8, false);
  } else if (name == "30B-A3B") {
    vision(27, 1152, 4304, 2048, {8, 16, 24}), text(2048, 6144, 48, 32, 4, false), experts(128, 8, 768);
  } else if (name == "235B-A22B") {
    vision(27, 1152, 4304, 4096, {8, 16, 24}), text(4096, 12288, 94, 64, 4, false), experts(128, 8, 1536);
  } else if (name == "tiny") {
    // For tests and the CPU demo: real vocabulary (the demo uses the real tokenizer), everything else tiny.
    vision(2, 64, 128, 64, {0}), text(64, 128, 2, 4, 2, true);
    v.heads = 4;
    t.head_dim = 16;
    t.mrope_section = {4, 2, 2};
  } else if (name == "tiny-moe") {
    // tiny with 4 experts (top-2) in every layer: the MoE paths (serving, expert and tensor parallelism) in seconds.
    vision(2, 64, 128, 64, {0}), text(64, 128, 2, 4, 2, true), experts(4, 2, 32);
    v.heads = 4;
    t.head_dim = 16;
    t.mrope_section = {4, 2, 2};
  } else if (name == "demo") {
    // The CPU demo: tiny's text side (its cost is the 151936-row LM head) with a wider, deeper vision tower and two
    // DeepStack taps, so that shapes, not only colours, are learned within minutes.
    vision(4, 128, 256, 64, {1, 2}), text(64, 128, 2, 4, 2, true);
    v.heads = 4;
    t.head_dim = 16;
    t.mrope_section = {4, 2, 2};
  } else {
    std::string known;
    for (auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    fail("config: unknown preset '" + name + "' (known: " + known + ")");
  }
  validate(c, "preset " + name);
  return c;
}

bool override_rope_theta(ModelConfig& c, double theta) {
  if (theta <= 0) return false;
  c.text.rope_theta = theta;
  return true;
}

bool cut_depth(ModelConfig& c, int64_t text_layers, int64_t vision_layers) {
  const std::vector<int>& ds = c.vision.deepstack_indexes;
  auto bad = [](const char* key, int64_t n, const std::string& why) {
    fail(std::string(key) + " = " + std::to_string(n) + ": " + why);
  };
  if (text_layers > c.text.layers)
    bad("model.text_layers", text_layers, "the model has " + std::to_string(c.text.layers) + " decoder layers");
  if (vision_layers > c.vision.depth)
    bad("model.vision_layers", vision_layers, "the vision tower has " + std::to_string(c.vision.depth) + " blocks");
  if (text_layers > 0 && text_layers < int64_t(ds.size()))
    bad("model.text_layers", text_layers,
        "the vision tower feeds DeepStack features into decoder layers 0.." + std::to_string(ds.size() - 1) +
            ": keep at least " + std::to_string(ds.size()));
  const int last = ds.empty() ? -1 : *std::max_element(ds.begin(), ds.end());
  if (vision_layers > 0 && vision_layers <= last) {
    std::string list;
    for (int i : ds) list += (list.empty() ? "" : ", ") + std::to_string(i);
    bad("model.vision_layers", vision_layers,
        "drops the DeepStack tap at ViT block " + std::to_string(last) + " (deepstack_visual_indexes [" + list +
            "]): keep at least " + std::to_string(last + 1) + " blocks");
  }
  const bool cut = (text_layers > 0 && text_layers < c.text.layers) || (vision_layers > 0 && vision_layers < c.vision.depth);
  if (text_layers > 0) {
    c.text.layers = int(text_layers);
    std::erase_if(c.text.mlp_only_layers, [&](int l) { return l >= text_layers; });
  }
  if (vision_layers > 0) c.vision.depth = int(vision_layers);
  validate(c, "the model cut by model.text_layers / model.vision_layers");
  return cut;
}

}  // namespace q3vl
