#include "q3vl/app/modes.hpp"

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "q3vl/core/error.hpp"
#include "q3vl/core/paths.hpp"
#include "q3vl/data/prepare.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/data/synth.hpp"
#include "q3vl/plan/plan.hpp"
#include "q3vl/runtime/check.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/tensor/dev.hpp"
#include "q3vl/serve/generate.hpp"
#include "q3vl/serve/server.hpp"
#include "q3vl/train/train.hpp"
#include "q3vl/train/eval.hpp"

namespace q3vl {

namespace {
// The compute the deck asks for exists here, checked before any work. Inference (generate, serve) may hold int8 or
// fp8 weights; train and eval need fp32 weights (no gradient or master for them).
void check_compute(const Deck& d, bool inference) {
  const bool cuda = d.str("model.backend") == "cuda";
  if (const std::string w = d.str("model.weight_dtype"); w != "fp32") {
    if (!inference)
      fail("model.weight_dtype = \"" + w + "\": " + w +
           " weights are for inference (generate, serve); train and eval need model.weight_dtype = \"fp32\"");
    weight_quant(d);  // refuses bf16/fp16
  }
  if (cuda && dev::device_count() == 0)
    fail("model.backend = \"cuda\": no GPU is visible to rank " + std::to_string(Runtime::get().where().rank) + " on " +
         Runtime::get().where().host + " (a build without CUDA, no driver, or CUDA_VISIBLE_DEVICES empty)");
  if (!cuda && d.str("model.dtype") != "fp32")
    fail("model.dtype = \"" + d.str("model.dtype") + "\": the CPU backend computes in fp32; set model.dtype = \"fp32\" "
         "or model.backend = \"cuda\"");
}
int with_compute(const Deck& d, int (*run)(const Deck&)) {
  check_compute(d, false);
  return run(d);
}
}  // namespace

void check_paths(const Deck& d, const std::string& mode, Comm& world) {
  // Reads are checked on rank 0 (every rank reads the same files); writes on every rank that writes.
  const bool root = world.rank() == 0;
  std::string err;
  auto need = [&](bool on, const std::string& problem) {
    if (on && err.empty()) err = problem;
  };
  auto given = [&](const char* key) { return !d.str(key).empty(); };
  const std::string out = d.str("run.out_dir");
  need(d.boolean("run.rank_logs") || (mode == "train" && root), need_writable_dir("run.out_dir", out));
  if (mode == "prepare" || mode == "tokenize")
    need(root, need_file("tokenizer.path", d.str("tokenizer.path")));
  if (mode == "generate" || mode == "serve") {  // the model's or checkpoint's tokenizer.json, unless the deck names one
    const std::string t = tokenizer_file(d, mode);
    need(root, need_file(t == d.str("tokenizer.path") ? "tokenizer.path" : "the model's tokenizer", t));
  }
  if ((mode == "train" || mode == "eval" || mode == "generate" || mode == "serve") && given("model.hf")) {
    need(root, need_dir("model.hf", d.str("model.hf")));
    need(root, need_file("model.hf's config", d.str("model.hf") + "/config.json"));
  }
  if (mode == "prepare") {
    need(root, need_file("prepare.input", d.str("prepare.input")));
    if (given("prepare.image_root")) need(root, need_dir("prepare.image_root", d.str("prepare.image_root")));
    // prepare.output: prepare_dataset checks it (a dataset there needs prepare.overwrite) before any work.
  } else if (mode == "train") {
    if (d.str("train.dataset") != "synthetic") need(root, need_file_or_dir("train.dataset", d.str("train.dataset")));
    const std::string r = d.str("train.resume");
    if (r != "auto" && r != "never") need(root, need_file("train.resume", r));
    // Every rank writes its part of each checkpoint: found unwritable now, not after all the steps.
    if (given("checkpoint.dir")) need(true, need_writable_dir("checkpoint.dir", d.str("checkpoint.dir")));
    else need(true, need_writable_dir("checkpoint.dir (run.out_dir/checkpoints)", out + "/checkpoints"));
  } else if (mode == "eval") {
    need(root, need_file("eval.batch", d.str("eval.batch")));
    need(root, need_output_file("eval.output", d.str("eval.output")));
  } else if (mode == "generate") {
    need(root, need_file("generate.prompts", d.str("generate.prompts")));
    need(root, need_output_file("generate.output", d.str("generate.output")));
    if (given("generate.checkpoint")) need(root, need_file_or_dir("generate.checkpoint", d.str("generate.checkpoint")));
  } else if (mode == "serve") {
    if (given("serve.checkpoint")) need(root, need_file_or_dir("serve.checkpoint", d.str("serve.checkpoint")));
    if (given("serve.image_dir")) need(root, need_dir("serve.image_dir", d.str("serve.image_dir")));
  } else if (mode == "synth") {
    need(root, need_writable_dir("synth.dir", d.str("synth.dir")));
  }
  agree_or_fail(world, err);
}

bool ModeArgs::has(const std::string& f) const { return std::find(flags.begin(), flags.end(), f) != flags.end(); }

const std::vector<Mode>& modes() {
  static const std::vector<Mode> table = {
      {"check", "preflight: every rank's host, device, memory and disk; all-reduce bandwidth between ranks",
       [](const Deck& d, const ModeArgs&) { return run_check(d); }},
      {"prepare", "JSONL conversations + images -> tokenized HDF5 shards (chat template, resized images)",
       [](const Deck& d, const ModeArgs&) { return run_prepare(d); }},
      {"tokenize", "stdin JSON strings -> JSON id arrays per line (--decode: the reverse), with tokenizer.path",
       [](const Deck& d, const ModeArgs& a) {
         tokenize_stream(Tokenizer::load(d.str("tokenizer.path")), std::cin, std::cout, a.has("--decode"));
         return 0;
       },
       {"--decode"}, true},
      {"train", "train with ZeRO data parallelism (AdamW, checkpoints, metrics.jsonl)",
       [](const Deck& d, const ModeArgs&) {
         if (d.str("parallel.layout") != "auto") return with_compute(d, run_train);
         Deck chosen = d;  // the planner's choice for the devices this job has
         choose_layout(chosen);
         return with_compute(chosen, run_train);
       }},
      {"eval", "forward (and backward) of a HF model over a batch file: logits, loss, grads to HDF5",
       [](const Deck& d, const ModeArgs&) { return with_compute(d, run_eval); }},
      {"generate", "answers for JSONL prompts with images (KV cache; greedy or seeded sampling) to JSONL",
       [](const Deck& d, const ModeArgs&) { return check_compute(d, true), run_generate(d); }},
      {"plan", "memory and step time of every training layout for the deck's model on plan.* hardware; the fastest "
               "that fits and its deck lines, or the smallest machine that would",
       [](const Deck& d, const ModeArgs&) { return run_plan(d); }, {}, true},
      {"serve", "OpenAI-compatible HTTP server (chat with images, SSE streaming) with continuous batching",
       [](const Deck& d, const ModeArgs&) { return check_compute(d, true), run_serve(d); }},
      {"synth", "the demo's synthetic data: PNG pictures of coloured shapes and train/eval JSONL conversations",
       [](const Deck& d, const ModeArgs&) { return run_synth(d); }},
  };
  return table;
}

const Mode* find_mode(const std::string& name) {
  for (const auto& m : modes())
    if (m.name == name) return &m;
  return nullptr;
}

}  // namespace q3vl
