#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "../errors.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/model/config.hpp"

using namespace q3vl;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kDir = "tests/data/config/";

struct Counts {
  int64_t vision = 0, text = 0, text_active = 0;
};

// Parameter counts from the tensor shapes of spec section 8 (independent of any q3vl parameter table).
Counts count_params(const ModelConfig& c) {
  const VisionConfig& v = c.vision;
  const TextConfig& t = c.text;
  const int64_t Dv = v.hidden, Iv = v.intermediate, Do = v.out_hidden, M = 4 * Dv;
  Counts n;
  n.vision = Dv * v.in_channels * v.temporal_patch * v.patch * v.patch + Dv  // patch_embed
             + int64_t(v.num_position_embeddings) * Dv                        // pos_embed
             + v.depth * (4 * Dv + 3 * Dv * Dv + 3 * Dv + Dv * Dv + Dv + Iv * Dv + Iv + Dv * Iv + Dv)
             + (2 * Dv + M * M + M + Do * M + Do)                              // merger (norm over Dv)
             + int64_t(v.deepstack_indexes.size()) * (2 * M + M * M + M + Do * M + Do);
  const int64_t H = t.hidden, V = t.vocab, hd = t.head_dim;
  const int64_t attn = 2 * H + t.heads * hd * H + 2 * t.kv_heads * hd * H + H * t.heads * hd + 2 * hd;
  const int64_t head = V * H + H + (t.tie_embeddings ? 0 : V * H);  // embed, final norm, lm_head
  n.text = n.text_active = head;
  for (int l = 0; l < t.layers; ++l) {
    n.text += attn, n.text_active += attn;
    if (c.is_moe_layer(l)) {
      const int64_t expert = 3 * H * t.moe_intermediate, router = int64_t(t.num_experts) * H;
      n.text += router + t.num_experts * expert;
      n.text_active += router + t.experts_per_tok * expert;
    } else {
      n.text += 3 * H * t.intermediate, n.text_active += 3 * H * t.intermediate;
    }
  }
  return n;
}

// Writes a modified copy of a fixture and loads it.
fs::path variant(const std::string& fixture, const std::function<void(json&)>& edit) {
  json j = json::parse(std::ifstream(kDir + fixture));
  edit(j);
  fs::path p = fs::temp_directory_path() / ("q3vl_cfg_" + std::to_string(::getpid()) + ".json");
  std::ofstream(p) << j.dump(1);
  return p;
}

}  // namespace

TEST(Config, PresetParameterCountsMatchSpec) {
  struct Row { const char* name; int64_t total, vision, active; };
  const Row rows[] = {
      {"2B", 2127532032, 406957056, 2127532032},
      {"4B", 4437815808, 415347712, 4437815808},
      {"8B", 8767123696, 576388336, 8767123696},
      {"32B", 33357390064, 595266800, 33357390064},
      {"30B-A3B", 31070754032, 538631408, 3891664112},
      {"235B-A22B", 235670022896, 576388336, 22767151856},
  };
  for (auto& r : rows) {
    Counts n = count_params(preset_config(r.name));
    EXPECT_EQ(n.vision + n.text, r.total) << r.name;
    EXPECT_EQ(n.vision, r.vision) << r.name;
    EXPECT_EQ(n.vision + n.text_active, r.active) << r.name;
  }
}

TEST(Config, PresetsAreConsistent) {
  for (auto& name : preset_names()) {
    ModelConfig c = preset_config(name);
    EXPECT_EQ(c.vision.out_hidden, c.text.hidden) << name;
    EXPECT_EQ(c.text.vocab, 151936) << name;
    EXPECT_EQ(c.vision.patch_dim(), 1536) << name;
    EXPECT_FALSE(c.experts_v5_layout) << name;
    EXPECT_EQ(c.transformers_version, "4.57.0") << name;  // the released schema and expert layout
    EXPECT_EQ(c.moe(), name == "30B-A3B" || name == "235B-A22B" || name == "tiny-moe") << name;
  }
  ModelConfig tiny = preset_config("tiny");
  EXPECT_EQ(tiny.text.hidden, 64);
  EXPECT_EQ(tiny.vision.deepstack_indexes, std::vector<int>{0});
  EXPECT_EQ(tiny.text.mrope_section[0] + tiny.text.mrope_section[1] + tiny.text.mrope_section[2], tiny.text.head_dim / 2);
  expect_error([] { preset_config("7B"); }, {"'7B'", "2B", "235B-A22B", "tiny"});
}

TEST(Config, DenseBothSchemasMatchPreset) {
  ModelConfig v4 = load_hf_config(kDir + "qwen3vl_4b_v4.json");
  ModelConfig v5 = load_hf_config(kDir + "qwen3vl_4b_v5.json");
  EXPECT_EQ(v4.transformers_version, "4.57.0.dev0");
  EXPECT_FALSE(v4.experts_v5_layout);
  EXPECT_EQ(v5.transformers_version, "5.17.0");
  EXPECT_TRUE(v5.experts_v5_layout);
  EXPECT_TRUE(v4.text.tie_embeddings);
  EXPECT_EQ(v4.text.mrope_section, (std::array<int, 3>{24, 20, 20}));
  EXPECT_EQ(v4.text.rope_theta, 5000000.0);
  ModelConfig preset = preset_config("4B");
  for (ModelConfig* c : {&v4, &v5}) {
    c->transformers_version = preset.transformers_version;
    c->experts_v5_layout = false;
    EXPECT_TRUE(*c == preset);
  }
}

TEST(Config, MoeBothSchemasMatchPreset) {
  ModelConfig v4 = load_hf_config(kDir + "qwen3vl_30b_a3b_v4.json");
  ModelConfig v5 = load_hf_config(kDir + "qwen3vl_30b_a3b_v5.json");
  EXPECT_TRUE(v4.moe());
  EXPECT_EQ(v4.text.num_experts, 128);  // from num_experts
  EXPECT_EQ(v5.text.num_experts, 128);  // from num_local_experts
  EXPECT_TRUE(v5.experts_v5_layout);
  EXPECT_FALSE(v5.text.tie_embeddings);  // top-level flag wins over text_config's
  EXPECT_EQ(v5.text.rope_theta, 5000000.0);  // rope_parameters keyed by layer type
  ModelConfig preset = preset_config("30B-A3B");
  for (ModelConfig* c : {&v4, &v5}) {
    c->transformers_version = preset.transformers_version;
    c->experts_v5_layout = false;
    EXPECT_TRUE(*c == preset);
  }
  for (int l = 0; l < 48; ++l) EXPECT_TRUE(v4.is_moe_layer(l));
}

// hf_config_json is read back as the config it was written from (operator== compares every field): every
// preset, every config fixture and golden model, and one with every optional field off its default.
TEST(Config, WrittenConfigReadsBack) {
  std::vector<std::pair<std::string, ModelConfig>> cases;
  for (auto& name : preset_names()) cases.push_back({"preset " + name, preset_config(name)});
  for (std::string f :
       {"qwen3vl_4b_v4.json", "qwen3vl_4b_v5.json", "qwen3vl_30b_a3b_v4.json", "qwen3vl_30b_a3b_v5.json"})
    cases.push_back({f, load_hf_config(kDir + f)});
  for (std::string m : {"dense_tied", "dense_untied", "moe"})
    cases.push_back({m, load_hf_config("tests/data/golden/" + m + "/model/config.json")});
  ModelConfig odd = preset_config("30B-A3B");
  odd.transformers_version = "4.57.1";
  odd.text.decoder_sparse_step = 2, odd.text.mlp_only_layers = {1, 6}, odd.text.router_aux_loss_coef = 0.0125;
  odd.text.rms_eps = 1e-5, odd.text.rope_theta = 1e6, odd.text.tie_embeddings = true, odd.text.vocab = 1000;
  odd.image_token_id = 990, odd.video_token_id = 991, odd.vision_start_token_id = 992, odd.vision_end_token_id = 993;
  odd.eos_token_id = 994, odd.pad_token_id = 995;
  odd.vision.patch = 14, odd.vision.merge = 3, odd.vision.num_position_embeddings = 1024;
  cases.push_back({"every field changed", odd});
  for (auto& [what, c] : cases) {
    const std::string text = hf_config_json(c);
    const ModelConfig back = parse_hf_config(text, what);
    EXPECT_TRUE(back == c) << what << ": written\n" << text << "read back as\n" << hf_config_json(back);
    const json j = json::parse(text);  // the released 4.57 schema
    EXPECT_TRUE(j["text_config"].contains("rope_scaling") && !j["text_config"].contains("rope_parameters")) << what;
    EXPECT_EQ(j["text_config"].contains("num_experts"), c.moe()) << what;
  }
  // The version always says the expert layout: a disagreeing or missing one is replaced.
  ModelConfig v5 = preset_config("30B-A3B");
  v5.experts_v5_layout = true;
  EXPECT_EQ(json::parse(hf_config_json(v5))["transformers_version"], "5.0.0");
  EXPECT_TRUE(parse_hf_config(hf_config_json(v5), "v5").experts_v5_layout);
  v5.experts_v5_layout = false, v5.transformers_version.clear();
  EXPECT_EQ(json::parse(hf_config_json(v5))["transformers_version"], "4.57.0");
}

TEST(Config, DifferenceNamesTheFirstKey) {
  const ModelConfig a = load_hf_config("tests/data/golden/moe/model/config.json");
  ModelConfig b = a;
  EXPECT_EQ(config_difference(a, b), "");
  b.experts_v5_layout = !a.experts_v5_layout, b.transformers_version = "";  // disk layout only
  EXPECT_EQ(config_difference(a, b), "");
  b.text.rope_theta = 10000;
  EXPECT_EQ(config_difference(a, b), "text_config.rope_theta: " + json(a.text.rope_theta).dump() +
                                         " in the checkpoint, 10000.0 here");
  b = a, b.text.mlp_only_layers = {1};
  EXPECT_NE(config_difference(a, b).find("text_config.mlp_only_layers: [] in the checkpoint, [1] here"),
            std::string::npos)
      << config_difference(a, b);
  EXPECT_NE(config_difference(a, preset_config("tiny")), "");
}

TEST(Config, MoeLayerRule) {
  ModelConfig c = preset_config("30B-A3B");
  c.text.decoder_sparse_step = 2;
  c.text.mlp_only_layers = {3};
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_FALSE(c.is_moe_layer(3));  // mlp_only wins
  EXPECT_TRUE(c.is_moe_layer(5));
  EXPECT_FALSE(preset_config("8B").is_moe_layer(1));
}

TEST(Config, SpecialTokenIdsFromConfig) {
  auto p = variant("qwen3vl_4b_v5.json", [](json& j) {
    j["text_config"]["vocab_size"] = 256;
    j["image_token_id"] = 250;
    j["video_token_id"] = 251;
    j["text_config"]["vision_start_token_id"] = 252;  // text_config is a fallback location
    j.erase("vision_start_token_id");
    j["vision_end_token_id"] = 253;
    j["text_config"]["eos_token_id"] = json::array({249, 248});
  });
  ModelConfig c = load_hf_config(p.string());
  EXPECT_EQ(c.image_token_id, 250);
  EXPECT_EQ(c.video_token_id, 251);
  EXPECT_EQ(c.vision_start_token_id, 252);
  EXPECT_EQ(c.vision_end_token_id, 253);
  EXPECT_EQ(c.eos_token_id, 249);
  fs::remove(p);
}

TEST(Config, Errors) {
  expect_error([] { load_hf_config(kDir + "nope.json"); }, {"nope.json", "cannot open"});
  auto p = variant("qwen3vl_4b_v4.json", [](json& j) { j["architectures"] = {"LlamaForCausalLM"}; });
  expect_error([&] { load_hf_config(p.string()); },
               {p.string(), "'LlamaForCausalLM'", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"});
  p = variant("qwen3vl_4b_v4.json", [](json& j) { j["text_config"].erase("num_key_value_heads"); });
  expect_error([&] { load_hf_config(p.string()); }, {p.string(), "'text_config.num_key_value_heads'", "missing"});
  p = variant("qwen3vl_4b_v4.json", [](json& j) { j["vision_config"]["depth"] = "24"; });
  expect_error([&] { load_hf_config(p.string()); }, {p.string(), "'vision_config.depth'", "integer", "\"24\""});
  p = variant("qwen3vl_4b_v4.json", [](json& j) { j["text_config"]["rope_scaling"].erase("mrope_section"); });
  expect_error([&] { load_hf_config(p.string()); }, {"'text_config.rope_scaling.mrope_section'", "missing"});
  p = variant("qwen3vl_4b_v5.json", [](json& j) { j["text_config"]["rope_parameters"].erase("rope_theta"); });
  expect_error([&] { load_hf_config(p.string()); }, {"'text_config.rope_parameters.rope_theta'", "missing"});
  p = variant("qwen3vl_4b_v4.json", [](json& j) { j["text_config"]["rope_scaling"]["mrope_section"] = {24, 20, 16}; });
  expect_error([&] { load_hf_config(p.string()); }, {p.string(), "mrope_section", "64"});
  p = variant("qwen3vl_30b_a3b_v5.json", [](json& j) { j["text_config"].erase("num_local_experts"); });
  expect_error([&] { load_hf_config(p.string()); }, {"'text_config.num_local_experts'", "missing"});
  p = variant("qwen3vl_4b_v4.json", [](json& j) { j["tie_word_embeddings"] = 1; });
  expect_error([&] { load_hf_config(p.string()); }, {"'tie_word_embeddings'", "true or false"});
  p = variant("qwen3vl_4b_v4.json", [](json& j) { j["vision_config"]["deepstack_visual_indexes"] = {5, 11, 30}; });
  expect_error([&] { load_hf_config(p.string()); }, {"deepstack_visual_indexes", "30"});
  std::ofstream(p) << "{\"architectures\": [";
  expect_error([&] { load_hf_config(p.string()); }, {p.string(), "not valid JSON"});
  fs::remove(p);
}

// model.text_layers / model.vision_layers (issue 30): the first layers kept; a cut past the depth, below the DeepStack
// taps' decoder layers or dropping a tap's ViT block is refused naming the key.
TEST(Config, CutDepthKeepsDeepStackValid) {
  ModelConfig c = preset_config("30B-A3B");
  EXPECT_TRUE(cut_depth(c, 6, 0));
  EXPECT_EQ(c.text.layers, 6);
  EXPECT_EQ(c.vision.depth, preset_config("30B-A3B").vision.depth);
  ModelConfig full = preset_config("2B");
  EXPECT_FALSE(cut_depth(full, 0, 0));
  EXPECT_EQ(full, preset_config("2B"));
  auto refused = [](int64_t t, int64_t v, const std::string& want) {
    ModelConfig m = preset_config("2B");  // deepstack_visual_indexes [5, 11, 17], 24 blocks, 28 layers
    try {
      cut_depth(m, t, v);
      ADD_FAILURE() << "expected a refusal: " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refused(29, 0, "model.text_layers = 29: the model has 28 decoder layers");
  refused(2, 0, "model.text_layers = 2: the vision tower feeds DeepStack features into decoder layers 0..2");
  refused(0, 17, "model.vision_layers = 17: drops the DeepStack tap at ViT block 17");
  refused(0, 25, "model.vision_layers = 25: the vision tower has 24 blocks");
  ModelConfig m = preset_config("2B");
  EXPECT_TRUE(cut_depth(m, 3, 18));
  EXPECT_EQ(m.text.layers, 3);
  EXPECT_EQ(m.vision.depth, 18);
}

TEST(Config, RopeThetaOverride) {
  ModelConfig c = preset_config("2B");
  EXPECT_FALSE(override_rope_theta(c, 0));  // the deck's default: the model's own base
  EXPECT_EQ(c, preset_config("2B"));
  EXPECT_TRUE(override_rope_theta(c, 5));
  EXPECT_EQ(c.text.rope_theta, 5.0);
  EXPECT_EQ(config_difference(preset_config("2B"), c).rfind("text_config.rope_theta", 0), 0u);
}
