// Qwen3-VL model configuration: what a HF config.json says (both the transformers 4.57 and 5.x schemas),
// or a built-in preset for the released sizes. Dense and MoE share one struct (num_experts == 0: dense).
#pragma once
#include <array>
#include <string>
#include <vector>

namespace q3vl {

struct VisionConfig {
  int depth = 0;                    // number of ViT blocks
  int hidden = 0;                   // Dv
  int intermediate = 0;             // Iv
  int heads = 16;                   // Hv
  int patch = 16;                   // P
  int temporal_patch = 2;           // Tp
  int merge = 2;                    // spatial merge m
  int in_channels = 3;              // C
  int num_position_embeddings = 2304;  // learned 48x48 table
  int out_hidden = 0;               // Dout (== text hidden for released sizes)
  std::vector<int> deepstack_indexes;  // ViT block indices feeding decoder layers 0,1,2...
  double ln_eps = 1e-6;
  int head_dim() const { return hidden / heads; }
  int patch_dim() const { return in_channels * temporal_patch * patch * patch; }  // 1536
  bool operator==(const VisionConfig&) const = default;
};

struct TextConfig {
  int vocab = 151936;
  int hidden = 0;                   // H
  int intermediate = 0;             // I (dense MLP)
  int layers = 0;                   // L
  int heads = 0;                    // nh
  int kv_heads = 0;                 // nkv
  int head_dim = 128;
  double rms_eps = 1e-6;
  double rope_theta = 5000000.0;
  std::array<int, 3> mrope_section{24, 20, 20};
  bool tie_embeddings = false;
  // MoE (num_experts == 0 means dense)
  int num_experts = 0;
  int experts_per_tok = 0;
  int moe_intermediate = 0;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  double router_aux_loss_coef = 0.001;
  bool operator==(const TextConfig&) const = default;
};

// Low-rank adapters (PEFT LoRA) on the linears whose module names match `targets` (src/model/lora.cpp).
// rank 0: none. Part of the model's shape: the parameter table holds the adapters next to the linears they wrap.
struct LoraConfig {
  int rank = 0;
  double alpha = 16, dropout = 0;
  bool rslora = false;
  std::vector<std::string> targets;  // PEFT target_modules patterns
  bool on() const { return rank > 0; }
  double scale() const;              // alpha / r, or alpha / sqrt(r) (rsLoRA)
  bool operator==(const LoraConfig&) const = default;
};

struct ModelConfig {
  std::string architecture;         // Qwen3VLForConditionalGeneration | Qwen3VLMoeForConditionalGeneration
  std::string transformers_version; // from config.json; decides the MoE expert layout on disk
  VisionConfig vision;
  TextConfig text;
  int image_token_id = 151655;
  int video_token_id = 151656;
  int vision_start_token_id = 151652;
  int vision_end_token_id = 151653;
  int eos_token_id = 151645;        // <|im_end|>
  int pad_token_id = 151643;        // <|endoftext|>
  // Expert tensors on disk: false = released layout gate_up [E,H,2Im], down [E,Im,H];
  // true = transformers-5 module layout gate_up [E,2Im,H], down [E,H,Im].
  bool experts_v5_layout = false;
  LoraConfig lora;                  // from the deck's [lora], never from config.json

  bool moe() const { return text.num_experts > 0; }
  // A placeholder the vision tower's features replace: an image's or a video's.
  bool visual_token(int64_t id) const { return id == image_token_id || id == video_token_id; }
  bool is_moe_layer(int l) const;   // HF rule: not in mlp_only_layers and (l+1) % decoder_sparse_step == 0
  bool operator==(const ModelConfig&) const = default;
};

// Read a HF config.json (4.57 or 5.x schema); `text`, if given, receives the file unchanged. Errors name the
// file and the key.
ModelConfig load_hf_config(const std::string& path, std::string* text = nullptr);
// The same from config.json text; `where` stands for the file in errors.
ModelConfig parse_hf_config(const std::string& text, const std::string& where);
// c as a config.json in the released 4.57 schema, which parse_hf_config reads back as c. Its
// transformers_version is c's, or 4.57.0 (5.0.0 when c.experts_v5_layout) where c's is empty or disagrees
// with that flag.
std::string hf_config_json(const ModelConfig& c);
// The first config.json key where two models compute differently ("text_config.rope_theta: 5000000 in the
// checkpoint, 10000 here"), or "" when they compute alike (the on-disk expert layout and dtype do not count).
std::string config_difference(const ModelConfig& checkpoint, const ModelConfig& here);
// Built-in presets: "2B", "4B", "8B", "32B", "30B-A3B", "235B-A22B" (and "tiny" for tests/demo).
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();
// model.text_layers / model.vision_layers: keep the first `text_layers` decoder layers and `vision_layers` ViT blocks
// of c (0: all), for benchmarks of a deep model's shapes. A cut is refused, naming the key, where it would exceed
// the model's depth, drop a DeepStack tap (a ViT block in deepstack_visual_indexes: its merger's weights and the
// decoder layer it feeds would silently change meaning, so it is not clipped) or leave fewer decoder layers than
// DeepStack taps. Returns whether anything was cut.
bool cut_depth(ModelConfig& c, int64_t text_layers, int64_t vision_layers);
// model.rope_theta: the text rotary's base in place of the model's where theta > 0 (train, generate and serve
// alike; the checkpoints and exports then carry it). Returns whether it did.
bool override_rope_theta(ModelConfig& c, double theta);

}  // namespace q3vl
