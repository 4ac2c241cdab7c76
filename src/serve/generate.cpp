#include "q3vl/serve/generate.hpp"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/data/chat.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/io/checkpoint.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/runtime/watchdog.hpp"
#include "q3vl/serve/engine.hpp"
#include "q3vl/tensor/dev.hpp"

namespace q3vl {

namespace fs = std::filesystem;

// O(V) per row, never a sort of the vocabulary (a server samples dozens of 151936-entry rows a step): greedy is
// dev::argmax_rows's CPU reference, the same pick serve's greedy steps make on the device; sampling sorts only the
// prefix that top_k / top_p keep, found by selecting ever larger heads.
int64_t sample_token(const float* logits, int64_t V, const SamplingParams& sp, std::mt19937_64& rng) {
  const int64_t lim = sp.vocab_limit > 0 ? std::min(sp.vocab_limit, V) : V;
  if (sp.temperature <= 0) {  // the first maximum among the allowed ids
    const std::vector<int32_t> banned(sp.banned.begin(), sp.banned.end());
    int32_t id = 0;
    float val = 0;
    dev::argmax_rows(dev::Exec{}, logits, 1, V, 0, lim, banned.data(), int64_t(banned.size()), &id, &val);
    return std::max<int64_t>(id, 0);
  }
  std::vector<char> ban;
  for (int64_t b : sp.banned)
    if (b >= 0 && b < lim) ban.resize(size_t(lim), 0), ban[size_t(b)] = 1;
  const auto allowed = [&](int64_t v) { return ban.empty() || !ban[size_t(v)]; };
  // Candidates by decreasing logit (ties: lower id first), cut to top_k, softmax at the temperature, cut to top_p.
  std::vector<int64_t> ids;
  ids.reserve(size_t(lim));
  for (int64_t v = 0; v < lim; ++v)
    if (allowed(v)) ids.push_back(v);
  if (ids.empty()) return 0;
  const auto by_logit = [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int64_t n = int64_t(ids.size()), k = sp.top_k > 0 ? std::min<int64_t>(sp.top_k, n) : n;
  if (k < n) std::nth_element(ids.begin(), ids.begin() + k, ids.end(), by_logit), ids.resize(size_t(k));
  float top = logits[ids[0]];
  for (int64_t v : ids) top = std::max(top, logits[v]);
  const double inv_t = 1 / sp.temperature;
  double sum = 0;
  for (int64_t v : ids) sum += std::exp(double(logits[v] - top) * inv_t);
  const auto p = [&](int64_t v) { return std::exp(double(logits[v] - top) * inv_t); };
  // The kept ids: the shortest prefix of the sorted order whose mass reaches top_p of the sum (all when top_p >= 1:
  // then order does not matter and nothing is sorted).
  int64_t keep = k;
  double mass = sum;
  if (sp.top_p < 1) {
    for (int64_t m = std::min<int64_t>(k, 64);; m = std::min(k, 4 * m)) {
      std::nth_element(ids.begin(), ids.begin() + (m - 1), ids.end(), by_logit);
      std::sort(ids.begin(), ids.begin() + m, by_logit);
      keep = 0, mass = 0;
      while (keep < m && (keep == 0 || mass < sp.top_p * sum)) mass += p(ids[keep++]);
      if (keep < m || mass >= sp.top_p * sum || m == k) break;
    }
  }
  // 53 random bits: the same draw on every platform for a seed.
  const double u = double(rng() >> 11) * 0x1.0p-53 * mass;
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i)
    if ((acc += p(ids[i])) > u) return ids[i];
  return ids[keep - 1];
}

GenPrompt encode_prompt(const Conversation& c, const std::vector<RgbImage>& images, const Tokenizer& tok,
                        const ImageConfig& icfg, const std::vector<VideoClip>& videos, const VideoConfig& vcfg) {
  if (images.size() != c.images.size())
    fail(c.where() + ": " + std::to_string(images.size()) + " pictures for " + std::to_string(c.images.size()) + " images");
  if (videos.size() != c.videos.size())
    fail(c.where() + ": " + std::to_string(videos.size()) + " clips for " + std::to_string(c.videos.size()) + " videos");
  std::vector<ImageGrid> grids;
  std::vector<std::vector<float>> ipix(images.size()), vpix(videos.size());
  for (size_t i = 0; i < images.size(); ++i) {
    try {
      grids.push_back(preprocess(images[i], icfg, ipix[i], c.images[i]));
    } catch (const Error& e) {
      fail(c.where() + ": image '" + c.images[i] + "': " + e.what());
    }
  }
  std::vector<VideoGrid> vgrids;
  for (size_t i = 0; i < videos.size(); ++i)
    vgrids.push_back({patchify_clip(videos[i], vcfg, vpix[i]),
                      clip_timestamps(videos[i].indices, videos[i].fps, vcfg.temporal_patch)});
  const EncodedChat e = encode_conversation(c, tok, grids, icfg.merge, vgrids);
  GenPrompt p;
  p.ids.assign(e.input_ids.begin(), e.input_ids.end());
  for (int32_t id : tok.encode("<|im_start|>assistant\n")) p.ids.push_back(id);
  // The visual spans in prompt order: the parts' order, a video's temporal patches one by one.
  size_t image = 0, video = 0;
  for (const ChatMessage& m : c.messages)
    for (const ChatPart& part : m.parts) {
      if (part.image) {
        const ImageGrid& g = grids[image];
        p.pixels.insert(p.pixels.end(), ipix[image].begin(), ipix[image].end());
        p.grid.insert(p.grid.end(), {g.t, g.h, g.w});
        ++image;
      } else if (part.video) {
        const ImageGrid& g = vgrids[video].grid;
        p.pixels.insert(p.pixels.end(), vpix[video].begin(), vpix[video].end());
        for (int t = 0; t < g.t; ++t) p.grid.insert(p.grid.end(), {1, g.h, g.w});
        ++video;
      }
    }
  return p;
}

GenPrompt make_prompt(const std::string& line_text, const std::string& file, long line, const Tokenizer& tok,
                      const ImageConfig& icfg, int64_t max_context, const VideoConfig& vcfg) {
  Conversation c = parse_line(line_text, file, line);
  // The answer the model is to give is not part of the prompt.
  while (!c.messages.empty() && c.messages.back().role == "assistant") c.messages.pop_back();
  if (c.messages.empty()) fail(c.where() + ": the record has no prompt (only assistant turns)");
  std::vector<RgbImage> images;
  for (const std::string& img : c.images) {
    const fs::path path = fs::path(img).is_absolute() ? fs::path(img) : fs::path(file).parent_path() / img;
    if (!fs::exists(path)) fail(c.where() + ": image '" + img + "' not found (looked for " + path.string() + ")");
    try {
      images.push_back(load_image(path.string()));
    } catch (const Error& e) {
      fail(c.where() + ": image '" + img + "': " + e.what());
    }
  }
  std::vector<VideoClip> videos;
  for (const VideoRef& v : c.videos)
    videos.push_back(load_video_part(v, vcfg, fs::path(file).parent_path().string(), video_part_name(v)));
  GenPrompt p = encode_prompt(c, images, tok, icfg, videos, vcfg);
  if ((int64_t)p.ids.size() > max_context)
    fail(c.where() + ": the prompt has " + std::to_string(p.ids.size()) + " tokens, more than generate.max_context = " +
         std::to_string(max_context));
  return p;
}

namespace {

// Weights from a training checkpoint: model/<hf name> at full shape, in the compute layout train writes.
// A LoRA checkpoint holds only the adapters (adapters_only): the base comes from the trained deck's model.hf first.
void load_checkpoint_weights(HostWeights& m, const std::string& path, bool adapters_only = false) {
  std::vector<CkptSlice> slices;
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().params()[id];
    if (adapters_only && p.part != Part::Lora) continue;
    slices.push_back({"model/" + p.name, p.shape, 0, p.numel, m.param((int)id)});
  }
  read_checkpoint(path, MPI_COMM_SELF, slices);
}

// The deck a checkpoint was trained with, when it trained adapters (null otherwise).
std::unique_ptr<Deck> lora_trained_deck(const std::string& ck) {
  if (ck.empty()) return nullptr;
  auto d = std::make_unique<Deck>(Deck::parse(read_checkpoint_meta(ck).deck_toml, ck, {}, ""));
  return d->integer("lora.rank") > 0 ? std::move(d) : nullptr;
}

// A checkpoint key names a file, or a checkpoint folder whose newest complete checkpoint is taken.
std::string checkpoint_path(const Deck& d, const std::string& key) {
  const std::string ck = d.str(key);
  if (ck.empty() || !fs::is_directory(ck)) return ck;
  std::vector<std::string> notes;
  const std::string found = find_resume_checkpoint(ck, &notes);
  for (const auto& n : notes)
    if (n.find("skip") != std::string::npos) log_warn(key + ": " + n);  // damaged checkpoints passed over
  if (found.empty()) fail(ck + ": no complete checkpoint in this folder");
  return found;
}

ModelConfig model_config_of(const Deck& d, const std::string& ck, const std::string& key) {
  if (!d.str("model.hf").empty()) return load_hf_config(d.str("model.hf") + "/config.json");
  if (!d.str("model.preset").empty()) return preset_config(d.str("model.preset"));
  if (!ck.empty()) {  // the model the checkpoint was trained as: its config.json, else (older files) its deck's
    const CkptMeta meta = read_checkpoint_meta(ck);
    if (!meta.hf_config_json.empty()) return parse_hf_config(meta.hf_config_json, ck + ":hf_config_json");
    const Deck trained = Deck::parse(meta.deck_toml, ck, {}, "");
    if (!trained.str("model.hf").empty()) return load_hf_config(trained.str("model.hf") + "/config.json");
    if (!trained.str("model.preset").empty()) return preset_config(trained.str("model.preset"));
  }
  const std::string mode = key.substr(0, key.find('.'));
  fail(mode + " needs a model: model.hf=DIR, model.preset=NAME (random weights) or " + key + "=FILE");
}
// The model to run, with model.rope_theta in place of its own where the deck gives one (as train does).
ModelConfig model_config(const Deck& d, const std::string& ck, const std::string& key) {
  ModelConfig c = model_config_of(d, ck, key);
  override_rope_theta(c, d.real("model.rope_theta"));
  return c;
}

}  // namespace

ModelSource model_source(const Deck& deck, const std::string& checkpoint_key) {
  ModelSource src;
  src.mode = checkpoint_key.substr(0, checkpoint_key.find('.'));
  src.checkpoint = checkpoint_path(deck, checkpoint_key);
  src.cfg = model_config(deck, src.checkpoint, checkpoint_key);
  // A LoRA checkpoint holds only its adapters: the base is the trained deck's (model.hf, else its random init).
  const std::unique_ptr<Deck> trained = lora_trained_deck(src.checkpoint);
  src.cfg.lora = lora_config(trained ? *trained : deck);
  if (trained) {
    src.adapters_only = true;
    src.base_hf = trained->str("model.hf");
    src.base_adapter = trained->str("lora.adapter");
    src.base_seed = uint64_t(trained->integer("run.seed"));
  }
  return src;
}

std::unique_ptr<HostWeights> load_model(const Deck& deck, const ModelSource& src) {
  auto model = std::make_unique<HostWeights>(src.cfg);
  ScopedTimer t(src.mode + ": load weights");
  if (src.adapters_only) {  // the trained base, then the checkpoint's adapters
    log_info(src.mode + ": base " +
             (src.base_hf.empty() ? "random init (seed " + std::to_string(src.base_seed) + ")" : src.base_hf) +
             ", adapters from " + src.checkpoint);
    if (src.base_hf.empty()) model->init_random(src.base_seed);
    else load_hf_weights(*model, src.base_hf);
    if (!src.base_adapter.empty()) load_lora_adapter(*model, src.base_adapter);  // its adapters: the checkpoint's
    load_checkpoint_weights(*model, src.checkpoint, true);
  } else if (!src.checkpoint.empty()) {
    log_info(src.mode + ": weights from " + src.checkpoint);
    load_checkpoint_weights(*model, src.checkpoint);
  } else if (!deck.str("model.hf").empty()) {
    load_hf_weights(*model, deck.str("model.hf"));
  } else {
    model->init_random(deck.integer("run.seed"));
  }
  if (!src.adapters_only && !deck.str("lora.adapter").empty()) {
    log_info(src.mode + ": adapters from " + deck.str("lora.adapter"));
    load_lora_adapter(*model, deck.str("lora.adapter"));
  }
  return model;
}

bool has_adapters(const Deck& deck, const ModelSource& src) {
  return src.adapters_only || !deck.str("lora.adapter").empty() || src.cfg.lora.on();
}

namespace {
// The pieces ps of the checkpoint's tensors. A tensor cut into several pieces (a row-parallel weight's columns under
// tensor parallelism: one range per row) is read once over the range that covers them, then copied out.
void read_checkpoint_slices(const std::string& path, const ParamTable& full, const std::vector<ParamSlice>& ps) {
  std::map<int, std::pair<int64_t, int64_t>> cover;  // param -> [begin, end) of its pieces
  for (const ParamSlice& p : ps) {
    auto [it, fresh] = cover.try_emplace(p.param, p.begin, p.begin + p.count);
    if (!fresh) it->second = {std::min(it->second.first, p.begin), std::max(it->second.second, p.begin + p.count)};
  }
  std::map<int, std::vector<float>> staged;
  std::vector<CkptSlice> cs;
  for (const ParamSlice& p : ps) {
    const auto [b, e] = cover[p.param];
    const bool whole_piece = b == p.begin && e == p.begin + p.count;
    if (!whole_piece && staged.count(p.param)) continue;
    float* dst = whole_piece ? p.dst : (staged[p.param] = std::vector<float>(size_t(e - b))).data();
    cs.push_back({"model/" + full.param(p.param).name, full.param(p.param).shape, b, e - b, dst});
  }
  read_checkpoint(path, MPI_COMM_SELF, cs);
  for (const ParamSlice& p : ps)
    if (auto it = staged.find(p.param); it != staged.end()) {
      const float* from = it->second.data() + (p.begin - cover[p.param].first);
      std::copy(from, from + p.count, p.dst);
    }
}
}  // namespace

bool stream_weights(const Deck& deck, const ModelSource& src, const ParamTable& local,
                    const std::function<std::vector<ParamSlice>(const UnitInfo&, float*)>& slices_of,
                    const std::function<void(int64_t, const float*, int64_t)>& sink) {
  if (has_adapters(deck, src)) return false;
  ScopedTimer tm(src.mode + ": load weights");
  const ParamTable full(src.cfg);
  const bool ck = !src.checkpoint.empty(), hf = !ck && !deck.str("model.hf").empty();
  log_info(src.mode + ": weights streamed a unit at a time from " +
           (ck ? src.checkpoint
               : hf ? deck.str("model.hf") : "a random init (seed " + std::to_string(deck.integer("run.seed")) + ")"));
  std::vector<float> buf;
  for (const UnitInfo& u : local.units()) {
    buf.resize(size_t(u.numel));
    const std::vector<ParamSlice> ps = slices_of(u, buf.data());
    if (ck) {
      read_checkpoint_slices(src.checkpoint, full, ps);
    } else if (hf) {
      load_hf_slices(full, deck.str("model.hf"), ps);
    } else {
      init_random_slices(full, uint64_t(deck.integer("run.seed")), 0.02, ps);  // on every core
    }
    sink(u.offset, buf.data(), u.numel);
  }
  return true;
}

bool stream_weights(const Deck& deck, const ModelSource& src, const ParamTable& t,
                    const std::function<void(int64_t, const float*, int64_t)>& sink) {
  return stream_weights(
      deck, src, t,
      [&](const UnitInfo& u, float* buf) {
        std::vector<ParamSlice> ps;
        for (int id : u.params) ps.push_back({id, 0, t.param(id).numel, buf + t.param(id).offset});
        return ps;
      },
      sink);
}

QFormat weight_quant(const Deck& deck) {
  const std::string w = deck.str("model.weight_dtype");
  if (w == "bf16" || w == "fp16")
    fail("model.weight_dtype = \"" + w + "\": the model stores every weight in model.dtype; with model.backend = "
         "\"cuda\" set model.dtype = \"" + w + "\" (and model.weight_dtype = \"fp32\"); the CPU backend computes in "
         "fp32, where model.weight_dtype = \"int8\" or \"fp8\" makes the weights 4x smaller");
  return w == "int8" ? QFormat::Int8 : w == "fp8" ? QFormat::Fp8 : QFormat::None;
}

std::unique_ptr<HostWeights> fold_lora(HostWeights& m, const std::string& mode, const std::string& why) {
  const ParamTable& t = m.table();
  // An adapter on a tied head would change the embeddings too: the folded model gets an untied head of its own.
  const int ha = t.lora_a(t.lm_head());
  const bool untie = ha >= 0 && lora_tied_head(t, ha);
  ModelConfig c = m.config();
  c.lora = {};
  if (untie) c.text.tie_embeddings = false;
  auto base = std::make_unique<HostWeights>(c);
  for (size_t id = 0; id < base->table().params().size(); ++id) {
    const ParamInfo& p = base->table().params()[id];
    const float* src = m.param(untie && (int)id == base->table().lm_head() ? t.embed_tokens() : t.id(p.name));
    std::copy(src, src + p.numel, base->param((int)id));
  }
  std::vector<float*> ptrs(t.params().size());
  for (size_t id = 0; id < ptrs.size(); ++id)
    ptrs[id] = t.params()[id].part == Part::Lora ? m.param((int)id) : base->param(base->table().id(t.params()[id].name));
  const int n = lora_merge(t, m.config().lora.scale(), ptrs.data(),
                           untie ? base->param(base->table().lm_head()) : nullptr);
  log_info(mode + ": " + std::to_string(n) + " LoRA adapters folded into the base for " + why +
           (untie ? " (the LM head's into an untied copy of the embeddings)" : ""));
  return base;
}

std::string tokenizer_file(const Deck& d, const std::string& mode) {
  if (d.given("tokenizer.path")) return d.str("tokenizer.path");
  const std::string dir = d.str("model.hf"), ck = d.str(mode + ".checkpoint");
  if (!dir.empty() && fs::is_regular_file(dir + "/tokenizer.json")) return dir + "/tokenizer.json";
  if (!ck.empty()) {  // a checkpoint folder carries its run's tokenizer (train copies it there)
    const fs::path folder = fs::is_directory(ck) ? fs::path(ck) : fs::path(ck).parent_path();
    if (fs::is_regular_file(folder / "tokenizer.json")) return (folder / "tokenizer.json").string();
  }
  return d.str("tokenizer.path");
}

Tokenizer load_tokenizer(const Deck& d, const std::string& mode) {
  const std::string path = tokenizer_file(d, mode);
  log_info(mode + ": tokenizer " + path);
  return Tokenizer::load(path);
}

ImageConfig image_config(const Deck& d, const std::string& mode, const ModelConfig& cfg) {
  ImageConfig ic;
  ic.patch = cfg.vision.patch;
  ic.temporal_patch = cfg.vision.temporal_patch;
  ic.merge = cfg.vision.merge;
  ic.min_pixels = d.integer(mode + ".min_pixels");
  ic.max_pixels = d.integer(mode + ".max_pixels");
  // The bounds the model was trained with travel in its directory (tools/export_hf writes them); the deck wins.
  const std::string pp = d.str("model.hf") + "/preprocessor_config.json";
  if (d.str("model.hf").empty() || !fs::is_regular_file(pp)) return ic;
  try {
    std::ifstream f(pp);
    const nlohmann::json j = nlohmann::json::parse(f);
    const nlohmann::json size = j.value("size", nlohmann::json::object());
    if (!d.given(mode + ".min_pixels"))
      ic.min_pixels = size.value("shortest_edge", j.value("min_pixels", ic.min_pixels));
    if (!d.given(mode + ".max_pixels"))
      ic.max_pixels = size.value("longest_edge", j.value("max_pixels", ic.max_pixels));
  } catch (const nlohmann::json::exception& e) {
    fail(pp + ": " + e.what());
  }
  if (ic.min_pixels > ic.max_pixels)
    fail(pp + ": the image bounds are reversed (min_pixels " + std::to_string(ic.min_pixels) + " > max_pixels " +
         std::to_string(ic.max_pixels) + ")");
  return ic;
}

VideoConfig video_config(const Deck& d, const ModelConfig& cfg) {
  VideoConfig v = video_config(d);
  v.patch = cfg.vision.patch, v.temporal_patch = cfg.vision.temporal_patch, v.merge = cfg.vision.merge;
  return v;
}

SamplingParams model_sampling(const ModelConfig& cfg, const Tokenizer& tok) {
  SamplingParams sp;
  sp.stop = {cfg.eos_token_id};
  sp.vocab_limit = std::min<int64_t>(cfg.text.vocab, (int64_t)tok.vocab_size());
  sp.banned = {cfg.image_token_id, cfg.video_token_id};
  return sp;
}

namespace {

// The prompts file, read and checked on rank 0 before any generation, so that a bad line fails fast.
struct PromptsFile {
  std::vector<GenPrompt> prompts;
  std::vector<long> lines;  // each prompt's line in the file
};
PromptsFile read_prompts(const Deck& deck, const ModelConfig& cfg, const Tokenizer& tok) {
  const ImageConfig icfg = image_config(deck, "generate", cfg);
  const VideoConfig vcfg = video_config(deck, cfg);
  const int64_t max_context = deck.integer("generate.max_context");
  const std::string in = deck.str("generate.prompts");
  std::ifstream f(in);
  if (!f) fail(in + ": cannot open the prompts file");
  PromptsFile pf;
  long ln = 0;
  for (std::string text; std::getline(f, text);) {
    ++ln;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    pf.prompts.push_back(make_prompt(text, in, ln, tok, icfg, max_context, vcfg));
    pf.lines.push_back(ln);
  }
  // Nothing to answer would still replace the output with an empty file.
  if (pf.prompts.empty()) fail("generate.prompts '" + in + "' holds no prompts (an empty file?)");
  log_info("generate: " + std::to_string(pf.prompts.size()) + " prompt(s) from " + in);
  return pf;
}

// generate_config on every rank: rank 0's, from its prompts; the other ranks wait for it without a deadline (rank 0
// may read images for long).
EngineConfig shared_config(const Deck& deck, const ModelConfig& cfg, const PromptsFile& pf, int64_t max_new) {
  Comm& world = Runtime::get().world();
  EngineConfig c = generate_config(deck, cfg, pf.prompts, max_new);
  if (world.size() == 1) return c;
  DevModel::InferBudget& b = c.budget;
  int64_t v[6] = {b.tokens, b.segments, b.patches, b.kv_blocks, b.block, b.seq_blocks};
  const double t = world.timeout();
  world.set_timeout(0);
  {
    Blocking guard("waiting for rank 0 to read the prompts");
    world.broadcast(v, 6, DType::I64, 0);
  }
  world.set_timeout(t);
  b = {v[0], v[1], v[2], v[3], v[4], v[5]};
  c.step_tokens = b.tokens;
  return c;
}

// The answers, in the prompts' order, to generate.output (written whole, then renamed into place).
void write_answers(const std::string& out, const PromptsFile& pf, const std::vector<int64_t>& prompt_tokens,
                   const std::vector<GenResult>& res, const Tokenizer& tok) {
  if (auto parent = fs::path(out).parent_path(); !parent.empty()) fs::create_directories(parent);
  const std::string tmp = out + ".partial";  // an existing output is never left half-written
  std::ofstream o(tmp);
  if (!o) fail(out + ": cannot write");
  for (size_t i = 0; i < res.size(); ++i) {
    const std::vector<int32_t> ids(res[i].tokens.begin(), res[i].tokens.end());
    nlohmann::json rec = {{"line", pf.lines[i]},
                          {"answer", tok.decode(ids)},
                          {"prompt_tokens", prompt_tokens[i]},
                          {"new_tokens", ids.size()},
                          {"stop", res[i].stopped ? "eos" : "length"}};
    o << rec.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
  o.close();
  if (!o) fail(out + ": write failed");
  fs::rename(tmp, out);
}

}  // namespace

// The offline driver of the engine: rank 0 reads the prompts, every rank loads its part of the model (the layout of
// serve.tp x serve.pp), and rank 0 feeds the prompts to the scheduler as jobs, generate.batch at a time with
// continuous batching, while the other ranks follow its steps.
int run_generate(const Deck& deck) {
  Runtime& rt = Runtime::get();
  const bool root = rt.where().rank == 0;
  const ModelSource src = model_source(deck, "generate.checkpoint");
  std::unique_ptr<Tokenizer> tok;
  PromptsFile pf;
  if (root) {
    tok = std::make_unique<Tokenizer>(load_tokenizer(deck, "generate"));
    pf = read_prompts(deck, src.cfg, *tok);
  }
  const int64_t max_new = deck.integer("generate.max_new_tokens");
  Engine e(deck, shared_config(deck, src.cfg, pf, max_new));
  e.load();
  if (!root) {
    e.runner.follow();
  } else {
    SamplingParams sp = model_sampling(src.cfg, *tok);
    sp.temperature = deck.real("generate.temperature");
    sp.top_k = (int)deck.integer("generate.top_k");
    sp.top_p = deck.real("generate.top_p");
    sp.seed = (uint64_t)deck.integer("run.seed");
    sp.max_new_tokens = (int)max_new;
    e.scheduler.configure(e.config, nullptr, sp);
    std::vector<int64_t> prompt_tokens;
    for (const GenPrompt& p : pf.prompts) prompt_tokens.push_back((int64_t)p.ids.size());
    const double t0 = wall_seconds();
    std::vector<GenResult> res;
    {
      ScopedTimer t("generate: batches");
      res = e.generate(std::move(pf.prompts), sp);
    }
    e.runner.stop();
    const std::string out = deck.str("generate.output");
    write_answers(out, pf, prompt_tokens, res, *tok);
    int64_t new_tokens = 0;
    for (const GenResult& r : res) new_tokens += (int64_t)r.tokens.size();
    char msg[256];
    std::snprintf(msg, sizeof msg, "generate: %lld new tokens in %.2f s -> %s", (long long)new_tokens,
                  wall_seconds() - t0, out.c_str());
    log_info(msg);
  }
  idle_barrier(rt.world(), "waiting for rank 0 to generate");
  return 0;
}

}  // namespace q3vl
