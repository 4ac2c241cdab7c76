// `q3vl generate`: answers for prompts with images, read from a JSONL file in the training-data format, by a HF
// model or a training checkpoint, with greedy or seeded sampling: the offline driver of serve's engine
// (serve/engine.hpp), on the GPU (model.backend = "cuda") or on the CPU op layer ("cpu"). Also what generate and
// serve share: prompts, sampling, the model's source and its weights.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/core/dtype.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/video_processor.hpp"
#include "q3vl/model/batch.hpp"
#include "q3vl/model/positions.hpp"
#include "q3vl/model/weights.hpp"

namespace q3vl {

class Tokenizer;
struct Conversation;

struct SamplingParams {
  double temperature = 0;     // 0: greedy (argmax, lowest id on ties)
  int top_k = 0;              // keep the k most likely tokens (0: all)
  double top_p = 1;           // then the smallest set whose probability reaches top_p
  uint64_t seed = 0;          // prompt i samples from its own stream seeded with (seed, i)
  int max_new_tokens = 64;
  std::vector<int64_t> stop;  // generation ends after any of these (not part of the answer)
  // Never generated: ids >= vocab_limit (the model's padded vocabulary beyond the tokenizer; 0: no limit) and the
  // image/video pads (they would need pixels).
  int64_t vocab_limit = 0;
  std::vector<int64_t> banned;
};

// Picks the next token from one row of logits [V].
int64_t sample_token(const float* logits, int64_t V, const SamplingParams& sp, std::mt19937_64& rng);

struct GenPrompt {
  std::vector<int64_t> ids;  // the templated prompt, image and video pads expanded
  // Its visual spans in prompt order, patchified: an image, or one temporal patch of a video as a grid [1, h, w]
  // (model/positions.hpp's visual_input: what mrope_positions, vision_features and step take).
  std::vector<float> pixels;
  std::vector<int64_t> grid;  // [spans * 3]
};

// One prompt's answer (Engine::generate).
struct GenResult {
  std::vector<int64_t> tokens;  // generated, without the stop token
  bool stopped = false;         // ended on a stop token (else on max_new_tokens)
};

// One JSONL record as a generation prompt: the chat template of data/chat.hpp with the assistant turns at the end
// dropped and "<|im_start|>assistant\n" appended; images read relative to the JSONL file's folder. Errors name
// file:line (bad record, unknown role, missing or unreadable image, prompt longer than max_context tokens).
// Videos: files (FFmpeg, only the sampled frames decoded) or lists of frame images, relative to the same folder.
GenPrompt make_prompt(const std::string& line_text, const std::string& file, long line, const Tokenizer& tok,
                      const ImageConfig& icfg, int64_t max_context, const VideoConfig& vcfg = {});

// generate's make_prompt after parsing, and serve's: a conversation whose images are given decoded (in
// c.images order) -> template, image pads, pixels, "<|im_start|>assistant\n" appended. Errors name c.where().
// Videos given sampled and resized (in c.videos order, data/video_processor.hpp's VideoClip), patchified with vcfg.
GenPrompt encode_prompt(const Conversation& c, const std::vector<RgbImage>& images, const Tokenizer& tok,
                        const ImageConfig& icfg, const std::vector<VideoClip>& videos = {},
                        const VideoConfig& vcfg = {});

// The model generate and serve run, chosen by the deck: model.hf, model.preset (random weights) or the checkpoint
// under checkpoint_key (a file, or a folder: its newest complete checkpoint; config from the checkpoint).
struct ModelSource {
  std::string mode;        // "generate" or "serve", for messages
  std::string checkpoint;  // resolved file, or empty
  ModelConfig cfg;         // cfg.lora: the LoRA checkpoint's trained [lora], else the deck's (lora.adapter)
  // A LoRA checkpoint (its trained deck has lora.rank > 0) holds only adapters: load_model builds its base first
  // from the trained deck's model.hf, else its random init from run.seed, with the base weights of the PEFT folder
  // the run started from (its lora.adapter: lm_head.base_layer.weight and the like replace the base's).
  bool adapters_only = false;
  std::string base_hf, base_adapter;
  uint64_t base_seed = 0;
};
ModelSource model_source(const Deck& deck, const std::string& checkpoint_key);
// The weights: base (checkpoint, model.hf or random), then the adapters (the LoRA checkpoint's, or lora.adapter's
// PEFT folder on top of a base).
std::unique_ptr<HostWeights> load_model(const Deck& deck, const ModelSource& src);
// Adapters come with the weights (a LoRA checkpoint, lora.adapter or a [lora] deck): only load_model loads them.
bool has_adapters(const Deck& deck, const ModelSource& src);
// load_model's weights one unit at a time, for a model that lives on a device: sink(offset, values, n) receives each
// unit's values (table order; offset: the unit's place in the concatenated table), so the host never holds more than
// the largest unit (a MoE layer's experts). Returns false, having done nothing, when has_adapters.
bool stream_weights(const Deck& deck, const ModelSource& src, const ParamTable& t,
                    const std::function<void(int64_t, const float*, int64_t)>& sink);
// The same for a model whose table `local` holds pieces of the source's tensors (a tensor-parallel slice):
// slices_of(unit, buf) names them, as slices of the full table (src.cfg's) written into the unit's buffer buf.
bool stream_weights(const Deck& deck, const ModelSource& src, const ParamTable& local,
                    const std::function<std::vector<ParamSlice>(const UnitInfo&, float*)>& slices_of,
                    const std::function<void(int64_t, const float*, int64_t)>& sink);
// model.weight_dtype as the device model's format: Int8 for "int8", Fp8 for "fp8" (the model's linears quantized as
// the weights arrive), None for "fp32"; "bf16"/"fp16" are refused, naming model.dtype, the storage of every weight
// (the CPU backend computes in fp32).
QFormat weight_quant(const Deck& deck);
// Inference needs no separate adapters: a model with LoRA adapters as a plain model with them folded in (W += scale
// B A, as export --merge does), for inference, which runs without adapters (`why` names it in the log line). An adapter on a tied head gives the folded model an untied head of its own.
std::unique_ptr<HostWeights> fold_lora(HostWeights& m, const std::string& mode, const std::string& why);
// A model directory is self-sufficient: tokenizer.json and the image pixel bounds (preprocessor_config.json's
// size.shortest_edge / longest_edge) come from model.hf unless the deck gives tokenizer.path / MODE.min_pixels /
// MODE.max_pixels (MODE: "generate" or "serve"). So is a checkpoint folder: MODE.checkpoint's folder (or the file's)
// holds the tokenizer.json its run trained with.
std::string tokenizer_file(const Deck& d, const std::string& mode);
Tokenizer load_tokenizer(const Deck& d, const std::string& mode);  // tokenizer_file's, named in the log
ImageConfig image_config(const Deck& d, const std::string& mode, const ModelConfig& cfg);
// The run's video sampling and resizing (data/video_processor.hpp's video_config: model.hf's file, the deck's video.*)
// with the model's patch sizes: what generate and serve process videos with.
VideoConfig video_config(const Deck& d, const ModelConfig& cfg);
// What every request of a model shares: stop on eos; never the padded vocabulary or the image/video pads.
SamplingParams model_sampling(const ModelConfig& cfg, const Tokenizer& tok);

int run_generate(const Deck& deck);

}  // namespace q3vl
