#include "q3vl/train/eval.hpp"

#include <filesystem>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/io/h5.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/tensor/tensor.hpp"

namespace q3vl {

Batch read_batch_h5(const std::string& path, int64_t patch_dim) {
  H5File f = H5File::open(path);
  Batch b;
  std::vector<int64_t> shape;
  b.input_ids = f.read<int64_t>("input_ids", &shape);
  if (shape.size() != 2) fail(path + ": input_ids must be [B,S], got " + shape_str(shape));
  b.B = int(shape[0]), b.S = int(shape[1]);
  auto same = [&](const char* name) {
    std::vector<int64_t> s;
    std::vector<int64_t> v = f.read<int64_t>(name, &s);
    if (s != shape) fail(path + ": " + name + " has shape " + shape_str(s) + ", input_ids " + shape_str(shape));
    return v;
  };
  b.attention_mask = f.exists("attention_mask") ? same("attention_mask") : std::vector<int64_t>(b.input_ids.size(), 1);
  b.labels = f.exists("labels") ? same("labels") : std::vector<int64_t>(b.input_ids.size(), -100);
  // pixel_values + image_grid_thw, pixel_values_videos + video_grid_thw: transformers' names, each pair optional.
  const auto visual = [&](const char* px, const char* grid, std::vector<float>& pv, std::vector<int64_t>& g) {
    if (!f.exists(px) && !f.exists(grid)) return;
    if (!f.exists(px) || !f.exists(grid)) fail(path + ": " + px + " and " + grid + " go together");
    std::vector<int64_t> ps, gs;
    pv = f.read<float>(px, &ps);
    if (ps.size() != 2 || ps[1] != patch_dim)
      fail(path + ": " + px + " must be [N," + std::to_string(patch_dim) + "], got " + shape_str(ps));
    g = f.read<int64_t>(grid, &gs);
    if (gs.size() != 2 || gs[1] != 3) fail(path + ": " + grid + " must be [n,3], got " + shape_str(gs));
    int64_t patches = 0;
    for (size_t i = 0; i < g.size(); i += 3) patches += g[i] * g[i + 1] * g[i + 2];
    if (patches != ps[0])
      fail(path + ": " + grid + " describes " + std::to_string(patches) + " patches, " + px + " has " +
           std::to_string(ps[0]));
  };
  visual("pixel_values", "image_grid_thw", b.pixel_values, b.image_grid_thw);
  visual("pixel_values_videos", "video_grid_thw", b.pixel_values_videos, b.video_grid_thw);
  return b;
}

EvalResult evaluate(DevModel& model, HostWeights& host, const Batch& batch, bool grads, bool aux_loss) {
  EvalResult r;
  model.zero_grads();
  {
    ScopedTimer t("eval: forward");
    r.loss = model.forward(batch, grads, &r.logits, &r.aux, aux_loss);
  }
  if (grads) {
    ScopedTimer t("eval: backward");
    model.backward();
    model.grads_to_host(host.grads());
    r.grads = grads_hf(host);
  }
  return r;
}

DevBudget budget_for(const Batch& batch, int64_t patch_dim) {
  DevBudget b;
  b.tokens = int64_t(batch.B) * batch.S;
  b.patches = int64_t(batch.pixel_values.size() + batch.pixel_values_videos.size()) / patch_dim;
  b.segments = batch.B;
  return b;
}

int run_eval(const Deck& deck) {
  Runtime& rt = Runtime::get();
  const std::string dir = deck.str("model.hf");
  if (dir.empty()) fail_all("eval needs a model: set model.hf=DIR (a Hugging Face model directory)");
  // One process does the work; the others only wait, so that the mode also runs under mpiexec.
  if (rt.where().rank == 0) {
    ModelConfig cfg = load_hf_config(dir + "/config.json");
    cfg.lora = lora_config(deck);
    // The host weights as read, and the gradients named for the file (grads_hf); the device model computes, on the
    // CPU op layer or the GPU.
    HostWeights model(cfg, deck.boolean("eval.grads"));
    std::vector<bool> tr;
    if (cfg.lora.on())  // a frozen base: gradients (eval.grads) for the adapters only
      for (const ParamInfo& p : model.table().params()) tr.push_back(p.part == Part::Lora);
    {
      ScopedTimer t("eval: load weights");
      load_hf_weights(model, dir);
      if (!deck.str("lora.adapter").empty()) load_lora_adapter(model, deck.str("lora.adapter"));
    }
    Batch batch = read_batch_h5(deck.str("eval.batch"), cfg.vision.patch_dim());
    const bool aux = deck.boolean("eval.router_aux_loss");
    if (aux && !cfg.moe()) log_warn("eval.router_aux_loss = true on a dense model: the aux loss is 0");
    EvalResult r;
    int64_t supervised = 0;
    const bool cuda = deck.str("model.backend") == "cuda";
    dev::Exec ex = dev::make_exec(cuda ? Device::CUDA : Device::CPU, size_t(256) << 20, std::max(0, rt.where().gpu));
    {
      DevModel dm(cfg, ex, compute_dtype(deck.str("model.dtype")));
      if (!tr.empty()) dm.set_frozen(tr);
      dm.reserve(budget_for(batch, cfg.vision.patch_dim()));
      dm.set_params(model.params());
      r = evaluate(dm, model, batch, deck.boolean("eval.grads"), aux);
      supervised = dm.supervised_tokens();
    }
    dev::destroy_exec(ex);

    const std::string out = deck.str("eval.output");
    if (auto parent = std::filesystem::path(out).parent_path(); !parent.empty())
      std::filesystem::create_directories(parent);
    // Written next to the target, then renamed: an existing output is never left half-written.
    const std::string tmp = out + ".partial";
    {
      H5File f = H5File::create(tmp);
      f.write<float>("logits", {batch.B, batch.S, cfg.text.vocab}, r.logits);
      f.write_scalar<double>("loss", r.loss);
      if (aux) f.write_scalar<double>("aux_loss", r.aux);
      for (const auto& g : r.grads) f.write<float>("grads/" + g.name, g.shape, g.data);
    }
    std::filesystem::rename(tmp, out);
    char line[256];
    std::snprintf(line, sizeof line, "eval: loss %.8f%s over %lld supervised tokens -> %s", r.loss,
                  aux ? (" (aux " + std::to_string(r.aux) + ")").c_str() : "",
                  static_cast<long long>(supervised), out.c_str());
    log_info(line);
  }
  idle_barrier(rt.world(), "waiting for rank 0 to evaluate");
  return 0;
}

}  // namespace q3vl
