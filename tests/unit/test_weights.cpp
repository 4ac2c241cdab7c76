// Sliced weight start-up without MPI: the counter-based random init (normal, per tensor, any slice equal to the
// full init), load_hf_slices against the whole-tensor load_hf_weights for arbitrary slices (dense and MoE, both
// expert layouts, BF16 and F32), and load_hf_slices' errors (the same messages as load_hf_weights'). PEFT adapter
// folders with the base weights PEFT saves beside the adapters (lm_head.base_layer.weight): whole and sliced, tied
// and untied heads, and their errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iterator>
#include <memory>

#include "../hf_dir.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/tensor/tensor.hpp"
#include "../reference/model_io.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

const std::string kDense = "tests/data/golden/dense_tied/model/config.json";
const std::string kMoe = "tests/data/golden/moe/model/config.json";

std::string tmpdir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("q3vl_wts_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d.string();
}

bool is_expert(const std::string& name) { return name.find("mlp.experts.") != std::string::npos; }

// Every tensor cut into slices of `chunk` elements (the last shorter), written where the model's storage has them.
std::vector<ParamSlice> chop(const ParamTable& t, int64_t chunk, float* base) {
  std::vector<ParamSlice> out;
  for (size_t id = 0; id < t.params().size(); ++id) {
    const ParamInfo& p = t.param(int(id));
    float* at = base + t.units()[size_t(p.unit)].offset + p.offset;
    for (int64_t b = 0; b < p.numel; b += chunk) out.push_back({int(id), b, std::min(chunk, p.numel - b), at + b});
  }
  return out;
}

std::string message(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Weights, RandomInitIsNormalPerTensor) {
  Model m(load_hf_config(kMoe));
  const double sd = 0.02;
  m.init_random(1, sd);
  double n = 0, s = 0, s2 = 0, tail = 0;
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().param(int(id));
    const float* x = m.param(int(id));
    if (p.no_decay) {
      const float want = p.name.size() > 5 && p.name.substr(p.name.size() - 5) == ".bias" ? 0.f : 1.f;
      for (int64_t j = 0; j < p.numel; ++j) ASSERT_EQ(x[j], want) << p.name << "[" << j << "]";
      continue;
    }
    for (int64_t j = 0; j < p.numel; ++j) n += 1, s += x[j], s2 += double(x[j]) * x[j], tail += std::fabs(x[j]) > 2 * sd;
  }
  ASSERT_GT(n, 1e5);
  EXPECT_LT(std::fabs(s / n), 5 * sd / std::sqrt(n));
  EXPECT_NEAR(std::sqrt(s2 / n), sd, 0.01 * sd);
  EXPECT_NEAR(tail / n, 0.0455, 0.003);  // P(|z| > 2) of a normal
  // Tensors of one shape get different values, and so do seeds.
  const ParamTable& t = m.table();
  const int q0 = t.layer(0) + tlay::q_proj, q1 = t.layer(1) + tlay::q_proj;
  const int64_t nq = t.param(q0).numel;
  EXPECT_NE(std::vector<float>(m.param(q0), m.param(q0) + nq), std::vector<float>(m.param(q1), m.param(q1) + nq));
  std::vector<float> first(m.param(q0), m.param(q0) + nq);
  m.init_random(2, sd);
  EXPECT_NE(first, std::vector<float>(m.param(q0), m.param(q0) + nq));
}

TEST(Weights, RandomInitSlicesMatchFullInit) {
  Model m(load_hf_config(kMoe));
  m.init_random(9, 0.3);
  std::vector<float> got(m.table().total(), -1.f);
  for (int64_t chunk : {1, 7, 1000}) {  // odd chunks start slices on both halves of a Box-Muller pair
    std::fill(got.begin(), got.end(), -1.f);
    const SliceBytes b = init_random_slices(m.table(), 9, 0.3, chop(m.table(), chunk, got.data()));
    EXPECT_EQ(b.mine, b.all);
    ASSERT_EQ(std::memcmp(got.data(), m.params(), got.size() * 4), 0) << "chunk " << chunk;
  }
}

// load_hf_slices (ranges, per-expert blocks) against load_hf_weights (whole tensors, transpose12).
TEST(Weights, HfSlicesMatchFullLoad) {
  struct Case { std::string config, version; StDtype dt; };
  for (const Case& c : {Case{kDense, "5.0.0", StDtype::BF16}, Case{kDense, "4.57.0", StDtype::F32},
                        Case{kMoe, "4.57.0", StDtype::BF16}, Case{kMoe, "4.57.0", StDtype::F32},
                        Case{kMoe, "5.2.0", StDtype::BF16}}) {
    SCOPED_TRACE(c.config + " " + c.version + " " + st_dtype_name(c.dt));
    const std::string dir = tmpdir("slices");
    const ModelConfig cfg = test::write_hf_dir(dir, c.config, c.version, c.dt, 4);
    EXPECT_EQ(cfg.experts_v5_layout, c.version[0] == '5');
    Model ref(cfg);
    load_hf_weights(ref, dir);
    const ParamTable& t = ref.table();
    bool released_expert = false;
    for (const ParamInfo& p : t.params())
      if (is_expert(p.name) && !cfg.experts_v5_layout) {
        released_expert = true;  // the file's order differs from ours: a layout mix-up cannot pass unseen
        EXPECT_NE(Safetensors::open(dir).read_f32(p.name), std::vector<float>(ref.param(t.id(p.name)),
                                                                               ref.param(t.id(p.name)) + p.numel));
      }
    std::vector<float> got(t.total());
    for (int64_t chunk : {int64_t(5), int64_t(333), int64_t(1) << 40}) {  // 5: mid-expert, both parities
      std::fill(got.begin(), got.end(), -1.f);
      const SliceBytes b = load_hf_slices(t, dir, chop(t, chunk, got.data()));
      ASSERT_EQ(std::memcmp(got.data(), ref.params(), got.size() * 4), 0) << "chunk " << chunk;
      EXPECT_EQ(b.all, int64_t(t.total() * st_dtype_size(c.dt)));
      if (!released_expert) {
        EXPECT_EQ(b.mine, b.all) << "chunk " << chunk;  // only the slices' bytes
      } else {
        EXPECT_GE(b.mine, b.all) << "chunk " << chunk;
      }
    }
    fs::remove_all(dir);
  }
}

// Missing, mis-shaped and unexpected tensors: the sliced load refuses them with load_hf_weights' message, which
// names the tensor; even a rank with no slices checks the whole directory.
TEST(Weights, HfSlicesErrors) {
  const std::string dir = tmpdir("errors");
  const ModelConfig cfg = test::write_hf_config(dir, kMoe, "4.57.0");
  Model a(cfg);
  a.init_random(3, 0.5);
  std::vector<std::vector<float>> keep;
  const test::TensorList good = test::hf_tensors(a, keep);
  const ParamTable& t = a.table();
  std::vector<float> buf(t.total());
  const std::string down = "model.language_model.layers.0.mlp.experts.down_proj";
  const std::vector<float> extra(6, 1.f);
  auto check = [&](const test::TensorList& ts, std::initializer_list<std::string> needles) {
    write_safetensors(dir + "/model.safetensors", ts);
    Model b(cfg);
    const std::string want = message([&] { load_hf_weights(b, dir); });
    for (const auto& n : needles) EXPECT_NE(want.find(n), std::string::npos) << want << "\nmissing: " << n;
    EXPECT_EQ(message([&] { load_hf_slices(t, dir, chop(t, 5, buf.data())); }), want);
    EXPECT_EQ(message([&] { load_hf_slices(t, dir, {}); }), want);
  };
  test::TensorList ts = good;
  ts.erase(ts.begin() + t.id(down));
  check(ts, {dir, "missing tensor " + down, "[4,32,64]"});
  ts = good;
  ts[size_t(t.id(down))].second.first = {4, 64, 32};  // the compute shape where the file needs the released one
  check(ts, {dir, "tensor " + down + " has shape [4,64,32]", "expert layout: released", "transformers_version"});
  ts = good;
  ts.push_back({"model.extra.weight", {{2, 3}, extra.data()}});
  check(ts, {dir, "unexpected tensor model.extra.weight [2,3]"});
  fs::remove_all(dir);
}

namespace {

const std::string kUntied = "tests/data/golden/dense_untied/model/config.json";
const std::string kHeadBase = "base_model.model.lm_head.base_layer.weight";
const std::string kEmbed = "model.language_model.embed_tokens.weight";

// A base HF directory (random, seed 4) and its config with LoRA on q_proj and the LM head, as PEFT wraps them.
ModelConfig lora_base(const std::string& dir, const std::string& from) {
  test::write_hf_dir(dir, from, "5.0.0", StDtype::F32, 4);
  ModelConfig cfg = load_hf_config(dir + "/config.json");
  cfg.lora.rank = 2;
  cfg.lora.targets = {"q_proj", "lm_head"};
  return cfg;
}

std::vector<float> values(Model& m, int id) { return {m.param(id), m.param(id) + m.table().param(id).numel}; }

// DIR/adapter_model.safetensors: src's adapters under PEFT's names, then `extra` tensors.
void write_adapter(const std::string& dir, Model& src, const test::TensorList& extra) {
  fs::create_directories(dir);
  test::TensorList ts;
  for (size_t id = 0; id < src.table().params().size(); ++id)
    if (const ParamInfo& p = src.table().param(int(id)); p.part == Part::Lora)
      ts.push_back({peft_name(p.name), {p.shape, src.param(int(id))}});
  ts.insert(ts.end(), extra.begin(), extra.end());
  write_safetensors(dir + "/adapter_model.safetensors", ts);
}

// The base, then the adapter folder: whole (load_lora_adapter), and sliced as train's start-up (load_hf_slices for
// the base parameters, then load_lora_slices for all), which must agree bit for bit. Returns the whole model.
std::unique_ptr<Model> load_both(const ModelConfig& cfg, const std::string& base, const std::string& adapter) {
  auto m = std::make_unique<Model>(cfg);
  load_hf_weights(*m, base);
  load_lora_adapter(*m, adapter);
  const ParamTable& t = m->table();
  std::vector<float> got(t.total(), -1.f);
  const std::vector<ParamSlice> all = chop(t, 7, got.data());
  std::vector<ParamSlice> base_slices;
  std::copy_if(all.begin(), all.end(), std::back_inserter(base_slices),
               [&](const ParamSlice& s) { return t.param(s.param).part != Part::Lora; });
  load_hf_slices(t, base, base_slices);
  load_lora_slices(t, adapter, all);
  EXPECT_EQ(std::memcmp(got.data(), m->params(), got.size() * 4), 0) << "the sliced load differs from the whole one";
  return m;
}

}  // namespace

// PEFT saves a wrapped lm_head's full weights beside the adapters (lm_head.base_layer.weight), and the embeddings
// under their own name with save_embedding_layers; they load in place of the base's. A tied head is the embeddings
// (PEFT's tied lm_head shares their storage): both change, and of two differing values lm_head's, loaded last by
// PEFT, is kept.
TEST(Weights, PeftBaseWeightsReplaceTheBase) {
  for (const std::string& from : {kDense, kUntied}) {
    SCOPED_TRACE(from);
    const std::string dir = tmpdir("peft_base"), ad = dir + "/adapter";
    const ModelConfig cfg = lora_base(dir, from);
    Model ref(cfg), src(cfg);
    load_hf_weights(ref, dir);
    src.init_random(8, 0.5);  // the adapters, and the weights that replace the base's
    const ParamTable& t = ref.table();
    const bool tied = t.lm_head() == t.embed_tokens();
    EXPECT_EQ(tied, from == kDense);
    const int head = t.lm_head(), embed = t.embed_tokens();
    const std::vector<int64_t> shape = hf_shape(t, head);
    auto expect_from_src = [&](Model& m, const std::vector<int>& replaced) {
      for (size_t id = 0; id < t.params().size(); ++id) {
        const bool want_src = t.param(int(id)).part == Part::Lora ||
                              std::find(replaced.begin(), replaced.end(), int(id)) != replaced.end();
        EXPECT_EQ(values(m, int(id)), values(want_src ? src : ref, int(id))) << t.param(int(id)).name;
      }
    };
    write_adapter(ad, src, {{kHeadBase, {shape, src.param(head)}}});
    expect_from_src(*load_both(cfg, dir, ad), {head});  // tied: head == embed
    ASSERT_NE(values(ref, head), values(src, head));
    // save_embedding_layers: the embeddings (and the head) under their modules' names, outside base_layer.
    std::vector<float> other(size_t(t.param(embed).numel), 0.25f);
    write_adapter(ad, src, {{peft_name(kEmbed), {hf_shape(t, embed), tied ? other.data() : src.param(embed)}},
                            {kHeadBase, {shape, src.param(head)}}});
    expect_from_src(*load_both(cfg, dir, ad), {embed, head});  // tied: lm_head's, not `other`
    fs::remove_all(dir);
  }
}

// A base weight of the wrong shape is refused naming the file, the tensor and the base weight it would replace;
// tensors that are no adapter and no base weight under PEFT's names (for this lora.targets) stay refused.
TEST(Weights, PeftBaseWeightsErrors) {
  const std::string dir = tmpdir("peft_err"), ad = dir + "/adapter", file = ad + "/adapter_model.safetensors";
  const ModelConfig cfg = lora_base(dir, kDense);
  Model src(cfg);
  src.init_random(8, 0.5);
  const ParamTable& t = src.table();
  const int embed = t.embed_tokens(), k = t.layer(0) + tlay::k_proj;
  const std::vector<int64_t> wrong{hf_shape(t, embed)[0], hf_shape(t, embed)[1] - 1};
  const std::string kbase = "base_model.model.model.language_model.layers.0.self_attn.k_proj.base_layer.weight";
  auto check = [&](const test::TensorList& extra, std::initializer_list<std::string> needles) {
    write_adapter(ad, src, extra);
    const std::string e = message([&] { load_both(cfg, dir, ad); });
    for (const auto& n : needles) EXPECT_NE(e.find(n), std::string::npos) << e << "\nmissing: " << n;
    EXPECT_EQ(message([&] { load_lora_slices(t, ad, {}); }), e) << "a rank with no slices checks the file too";
  };
  check({{kHeadBase, {wrong, src.param(embed)}}},
        {file + ": tensor " + kHeadBase + " has shape " + shape_str(wrong), "replaces the base model's " + kEmbed,
         shape_str(hf_shape(t, embed))});
  check({{"base_model.model.model.extra.weight", {{2, 2}, src.param(embed)}}},
        {file + ": unexpected tensor base_model.model.model.extra.weight (not an adapter of this model under "
                "lora.targets)"});
  check({{"base_model.model.lm_head.weight", {hf_shape(t, embed), src.param(embed)}}},  // lm_head is wrapped
        {file + ": unexpected tensor base_model.model.lm_head.weight (not an adapter"});
  check({{kbase, {hf_shape(t, k), src.param(k)}}},
        {file + ": unexpected tensor " + kbase, "lora.targets does not wrap model.language_model.layers.0.self_attn.k_proj"});
  fs::remove_all(dir);
}
