// LoRA (model/lora.hpp): adapter gradients against central differences on every wrapped linear (text attention and
// MLP, MoE router, vision blocks, mergers; with and without dropout), the merged-weights forward against the adapter
// forward, the frozen base getting no gradient, the [lora] deck checks and the adapter sizing. The LM head's adapter
// (module lm_head) is in every check, on tied and untied heads.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <functional>
#include <set>
#include <span>

#include "../compare.hpp"
#include "../errors.hpp"
#include "../gpu.hpp"
#include "q3vl/core/deck.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/model/lora.hpp"
#include "../reference/qwen3vl.hpp"
#include "q3vl/train/eval.hpp"
#include "tiny_model.hpp"

using namespace q3vl;
using q3vl::test::tiny;
using q3vl::test::fd_check;
using q3vl::test::tiny_batch;

namespace {

const std::vector<std::string> kAll = {"q_proj", "k_proj",   "v_proj",    "o_proj",      "gate_proj",  "up_proj",
                                       "down_proj", "mlp.gate", "attn.qkv", "attn.proj", "linear_fc1", "linear_fc2",
                                       "lm_head"};

ModelConfig lora_tiny(bool moe, int rank, double dropout, bool rslora, bool tie = false) {
  ModelConfig c = tiny(moe, tie);
  c.lora.rank = rank;
  c.lora.alpha = 3;
  c.lora.dropout = dropout;
  c.lora.rslora = rslora;
  for (const auto& t : kAll)
    if (moe || t != "mlp.gate") c.lora.targets.push_back(t);  // a dense model has no router: refused
  return c;
}

// B is zero at PEFT's init, which would make every A gradient zero: give B values so both are checked.
template <class T> void randomise_b(BasicModel<T>& m, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed)};
  std::normal_distribution<double> nd(0.0, 0.3);
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().params()[id];
    if (p.part == Part::Lora && p.name.find(".lora_B.") != std::string::npos)
      for (int64_t j = 0; j < p.numel; ++j) m.param(int(id))[j] = T(nd(rng));
  }
}

std::vector<bool> adapters_only(const ParamTable& t) {
  std::vector<bool> tr;
  for (const ParamInfo& p : t.params()) tr.push_back(p.part == Part::Lora);
  return tr;
}

void gradcheck(bool moe, double dropout, bool rslora, bool tie = false) {
  const ModelConfig cfg = lora_tiny(moe, 3, dropout, rslora, tie);
  BasicModel<double> m(cfg);
  m.init_random(7, 0.3);
  randomise_b(m, 5);
  m.set_trainable(adapters_only(m.table()));
  m.lora().train = dropout > 0;
  m.lora().seed = 11;
  m.lora().nonce = 3;  // a fixed mask: forward is then a deterministic function of the weights
  std::mt19937 rng(3);
  const Batch b = tiny_batch(rng);
  m.zero_grads();
  ASSERT_TRUE(std::isfinite(m.forward(b, true, nullptr, nullptr, moe)));
  m.backward();
  std::set<std::string> wrapped;
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().params()[id];
    if (p.part != Part::Lora) {
      EXPECT_EQ(m.grad(int(id)), nullptr) << p.name << ": a frozen base weight must get no gradient";
      continue;
    }
    wrapped.insert(m.table().param(m.table().lora_base(int(id))).name);
    ASSERT_NE(m.grad(int(id)), nullptr) << p.name;
    fd_check(m, b, moe, int(id), rng, 3, 1e-7);
  }
  // Every eligible linear of the tiny model is wrapped: 2 vision blocks x 4, 2 mergers (main, DeepStack) x 2, text layers x 7 (MoE
  // layer: 4 attention + router), the LM head (tied: the embedding's weight, output side only).
  EXPECT_EQ(wrapped.size(), size_t(8 + 4 + (moe ? 7 + 5 : 14) + 1)) << "moe " << moe;
  EXPECT_TRUE(wrapped.count(m.table().param(m.table().lm_head()).name)) << "the LM head has no adapter";
}

}  // namespace

TEST(Lora, DenseAdapterGradcheck) { gradcheck(false, 0.0, false); }
TEST(Lora, MoeAdapterGradcheckRsLora) { gradcheck(true, 0.0, true); }
TEST(Lora, DropoutAdapterGradcheck) { gradcheck(false, 0.3, false); }
TEST(Lora, TiedHeadAdapterGradcheck) { gradcheck(false, 0.3, false, true); }

// W + scale B A in place of the adapters gives the same logits (PEFT's merge_and_unload). A tied head's adapter folds
// into an untied head (a copy of the embeddings): the embedding lookup is not adapted.
TEST(Lora, MergedEqualsAdapterForward) {
  for (int kind = 0; kind < 3; ++kind) {
    const bool moe = kind == 1, tie = kind == 2;
    const ModelConfig cfg = lora_tiny(moe, 4, 0.0, false, tie);
    ModelConfig plain = cfg;
    plain.lora = LoraConfig{};
    plain.text.tie_embeddings = false;
    Model a(cfg), merged(plain);
    a.init_random(9, 0.2);
    randomise_b(a, 6);
    merged.init_random(9, 0.2);  // the same base: values are a function of (seed, name, index)
    const ParamTable& ta = a.table();
    const int64_t VH = ta.param(ta.lm_head()).numel;
    float* head = merged.param(merged.table().lm_head());
    if (tie) std::copy(a.param(ta.embed_tokens()), a.param(ta.embed_tokens()) + VH, head);
    // Fold a's adapters into merged's copy of the base (by name: adapters shift the ids after them).
    std::vector<float*> ptrs(ta.params().size());
    for (size_t i = 0; i < ptrs.size(); ++i) {
      const ParamInfo& p = ta.params()[i];
      ptrs[i] = p.part == Part::Lora ? a.param(int(i)) : merged.param(merged.table().id(p.name));
    }
    if (tie) {  // refused before anything is folded: the embeddings would change too
      EXPECT_NE(error_of([&] { lora_merge(ta, cfg.lora.scale(), ptrs.data()); }).find("tied head"), std::string::npos);
    }
    EXPECT_EQ(lora_merge(ta, cfg.lora.scale(), ptrs.data(), tie ? head : nullptr), moe ? 8 + 4 + 12 + 1 : 8 + 4 + 14 + 1);
    std::mt19937 rng(4);
    const Batch b = tiny_batch(rng);
    std::vector<float> la, lm;
    const double lossa = a.forward(b, false, &la), lossm = merged.forward(b, false, &lm);
    EXPECT_NEAR(lossa, lossm, 1e-5);
    ASSERT_EQ(la.size(), lm.size());
    EXPECT_LT(test::max_diff(la, lm), 1e-5) << "kind " << kind;  // NaN or Inf: +inf
    // And the adapters do something: without them the logits differ.
    ModelConfig bare = cfg;
    bare.lora = LoraConfig{};
    Model base(bare);
    base.init_random(9, 0.2);
    std::vector<float> lb;
    base.forward(b, false, &lb);
    EXPECT_GT(test::max_diff(la, lb), 1e-3);
  }
}

// The head's adapter alone, tied: generation (prefill) gives the training forward's last-row logits, and those differ
// from the base's by exactly scale * (h A^T) B^T's effect (the embedding rows are not touched).
TEST(Lora, TiedHeadAdapterInGeneration) {
  ModelConfig cfg = tiny(false, true);
  cfg.lora.rank = 2;
  cfg.lora.alpha = 4;
  cfg.lora.targets = {"lm_head"};
  Model m(cfg);
  m.init_random(3, 0.2);
  randomise_b(m, 8);
  const ParamTable& t = m.table();
  ASSERT_EQ(t.lm_head(), t.embed_tokens());
  ASSERT_GE(t.lora_a(t.lm_head()), 0);
  EXPECT_EQ(t.param(t.lora_a(t.lm_head())).name, "lm_head.lora_A.weight");
  EXPECT_EQ(t.param(t.lora_a(t.lm_head()) + 1).shape, (std::vector<int64_t>{cfg.text.vocab, 2}));
  EXPECT_EQ(t.params()[size_t(t.lora_a(t.lm_head()))].unit, t.params()[size_t(t.final_norm())].unit);
  const std::vector<int64_t> ids = {1, 5, 9, 13, 7, 3};
  Batch b;
  b.B = 1, b.S = int(ids.size()), b.input_ids = ids;
  std::vector<float> full;
  m.forward(b, false, &full);
  HostKvCache<float> cache;
  const std::vector<float> last = m.prefill({ids}, {}, {}, cache);
  const int64_t V = cfg.text.vocab;
  ASSERT_EQ(int64_t(last.size()), V);
  ModelConfig bare = cfg;
  bare.lora = {};
  Model base(bare);
  base.init_random(3, 0.2);
  std::vector<float> fb;
  base.forward(b, false, &fb);
  const auto last_row = [&](const std::vector<float>& l) { return std::span(l).subspan((ids.size() - 1) * V, V); };
  EXPECT_LT(test::max_diff(last, last_row(full)), 1e-5);  // NaN or Inf: +inf
  EXPECT_GT(test::max_diff(last, last_row(fb)), 1e-3);
}

// PEFT's init: B zero (the wrapped model computes what the base does), A uniform in +-1/sqrt(in).
TEST(Lora, PeftInit) {
  const ModelConfig cfg = lora_tiny(false, 4, 0.0, false);
  Model m(cfg);
  m.init_random(1, 0.02);
  int a_seen = 0;
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().params()[id];
    if (p.part != Part::Lora) continue;
    const float* w = m.param(int(id));
    if (p.name.find(".lora_B.") != std::string::npos) {
      for (int64_t j = 0; j < p.numel; ++j) ASSERT_EQ(w[j], 0.f) << p.name;
      continue;
    }
    ++a_seen;
    const double bound = 1 / std::sqrt(double(p.shape[1]));
    double mx = 0;
    for (int64_t j = 0; j < p.numel; ++j) {
      ASSERT_LE(std::fabs(w[j]), bound) << p.name;
      mx = std::max(mx, double(std::fabs(w[j])));
    }
    EXPECT_GT(mx, 0.5 * bound) << p.name;
  }
  EXPECT_GT(a_seen, 10);
}

TEST(Lora, ScaleAndSizing) {
  LoraConfig c;
  c.rank = 16;
  c.alpha = 32;
  EXPECT_DOUBLE_EQ(c.scale(), 2.0);
  c.rslora = true;
  EXPECT_DOUBLE_EQ(c.scale(), 8.0);
  ModelConfig cfg = tiny(false, false);
  cfg.lora.rank = 2;
  cfg.lora.targets = {"q_proj", "v_proj"};
  const LoraSize s = lora_size(cfg);
  // q_proj [32,32]: A [2,32] + B [32,2]; v_proj [16,32]: A [2,32] + B [16,2]; two layers.
  EXPECT_EQ(s.wrapped, 4);
  EXPECT_EQ(s.params, 2 * (64 + 64 + 64 + 32));
  EXPECT_EQ(s.state_bytes(), s.params * 16);
  const Model m(cfg);
  EXPECT_EQ(m.table().total(), s.base + s.params);
  // The LM head of a tied model: A [2, H=32] + B [V=64, 2]; the base is not counted twice.
  ModelConfig tied = tiny(false, true);
  tied.lora.rank = 2;
  tied.lora.targets = {"lm_head"};
  const LoraSize h = lora_size(tied);
  EXPECT_EQ(h.wrapped, 1);
  EXPECT_EQ(h.params, 2 * 32 + 64 * 2);
  EXPECT_EQ(Model(tied).table().total(), h.base + h.params);
}

TEST(Lora, PatternsAndNames) {
  EXPECT_TRUE(lora_pattern_match("q_proj", "model.language_model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(lora_pattern_match("proj", "model.language_model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(lora_pattern_match("mlp.gate", "model.language_model.layers.0.mlp.gate"));
  EXPECT_FALSE(lora_pattern_match("gate", "model.language_model.layers.0.mlp.gate_proj"));
  EXPECT_TRUE(lora_pattern_match("layers.1.*.q_proj", "model.language_model.layers.1.self_attn.q_proj"));
  EXPECT_FALSE(lora_pattern_match("layers.1.*.q_proj", "model.language_model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(lora_eligible("model.language_model.embed_tokens.weight"));
  EXPECT_FALSE(lora_eligible("model.visual.patch_embed.proj.weight"));
  EXPECT_TRUE(lora_eligible("model.visual.merger.linear_fc1.weight"));
  EXPECT_FALSE(lora_eligible("lm_head.weight"));  // wrapped apart, as module lm_head, tied or not
  EXPECT_EQ(peft_name("lm_head.lora_B.weight"), "base_model.model.lm_head.lora_B.weight");
  EXPECT_EQ(peft_name("model.language_model.layers.0.self_attn.q_proj.lora_A.weight"),
            "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight");
}

TEST(Lora, BadKeysAreRefusedNamingThem) {
  EXPECT_NE(error_of([] { Deck::load("", {"lora.rnak=4"}, "train"); }).find("lora.rank"), std::string::npos);
  EXPECT_NE(error_of([] { Deck::load("", {"lora.rank=-1"}, "train"); }).find("lora.rank"), std::string::npos);
  EXPECT_NE(error_of([] { Deck::load("", {"lora.dropout=1.5"}, "train"); }).find("lora.dropout"), std::string::npos);
  EXPECT_NE(error_of([] { lora_config(Deck::load("", {"lora.alpha=8"}, "train")); }).find("lora.alpha"),
            std::string::npos);
  EXPECT_NE(error_of([] { lora_config(Deck::load("", {"lora.rank=4", "lora.targets=q_proj,,v_proj"}, "train")); })
                .find("lora.targets"),
            std::string::npos);
  EXPECT_NE(error_of([] { lora_config(Deck::load("", {"lora.rank=4", "lora.adapter=/nonexistent"}, "train")); })
                .find("lora.adapter"),
            std::string::npos);
  ModelConfig cfg = tiny(false, false);
  cfg.lora = lora_config(Deck::load("", {"lora.rank=4", "lora.targets=q_proj,qq_proj"}, "train"));
  const std::string e = error_of([&] { Model m(cfg); });
  EXPECT_NE(e.find("lora.targets"), std::string::npos) << e;
  EXPECT_NE(e.find("'qq_proj'"), std::string::npos) << e;
  // A standard module this architecture lacks (the router on a dense model) is no error: one list serves both.
  cfg.lora.targets = {"q_proj", "mlp.gate"};
  EXPECT_EQ(error_of([&] { Model m(cfg); }), "");
  cfg.lora.targets = {"mlp.gate"};
  EXPECT_NE(error_of([&] { Model m(cfg); }).find("no linear of this model matches"), std::string::npos);
}

// The device model's adapters (model/dev_lora.cpp) against the host model's, on every wrapped linear with dropout
// in training mode: the same loss and the same gradient of every adapter matrix, and none for the frozen base. The
// CPU op layer runs the host's fp32 arithmetic; CUDA's fp32 agrees to rounding.
namespace {
void device_equals_host(bool moe, bool tie, double dropout, Device d, double tol) {
  SCOPED_TRACE(std::string(moe ? "moe" : "dense") + (tie ? ", tied" : "") + ", dropout " + std::to_string(dropout));
  const ModelConfig cfg = lora_tiny(moe, 3, dropout, false, tie);
  BasicModel<float> host(cfg);
  host.init_random(7, 0.3);
  randomise_b(host, 5);
  const std::vector<bool> tr = adapters_only(host.table());
  host.set_trainable(tr);
  host.lora().train = true, host.lora().seed = 11, host.lora().nonce = 3;
  std::mt19937 rng(3);
  const Batch b = tiny_batch(rng);
  host.zero_grads();
  const double want = host.forward(b, true, nullptr, nullptr, moe);
  host.backward();

  dev::Exec ex = dev::make_exec(d);
  double got;
  std::vector<float> g(size_t(host.table().total()));
  {
    DevModel m(cfg, ex, DType::F32);
    m.reserve(budget_for(b, cfg.vision.patch_dim()));
    m.set_params(host.params());
    m.set_frozen(tr);
    m.lora().train = true, m.lora().seed = 11, m.lora().nonce = 3;
    got = m.forward(b, true, nullptr, nullptr, moe);
    m.backward();
    m.grads_to_host(g.data());
  }
  dev::destroy_exec(ex);
  ASSERT_TRUE(std::isfinite(want) && std::isfinite(got));
  EXPECT_NEAR(got, want, tol * std::abs(want));
  const ParamTable& t = host.table();
  int checked = 0;
  for (size_t id = 0; id < t.params().size(); ++id) {
    const ParamInfo& p = t.param(int(id));
    const float* dg = g.data() + t.units()[size_t(p.unit)].offset + p.offset;
    if (p.part != Part::Lora) {
      EXPECT_EQ(test::max_abs(std::span<const float>(dg, size_t(p.numel))), 0.0)
          << p.name << ": a frozen base weight got a gradient";
      continue;
    }
    const std::span<const float> want(host.grad(int(id)), size_t(p.numel)), mine(dg, size_t(p.numel));
    ASSERT_GT(test::max_abs(want), 0) << p.name << ": the host gradient is zero, the comparison would prove nothing";
    EXPECT_LE(test::rel_max_diff(mine, want), tol) << p.name;  // +inf for NaN or Inf
    ++checked;
  }
  EXPECT_EQ(checked, 2 * (8 + 4 + (moe ? 7 + 5 : 14) + 1)) << "every adapter matrix compared";
}
}  // namespace

TEST(Lora, DeviceModelEqualsHostModelOnCpu) {
  for (bool moe : {false, true})
    for (bool tie : {false, true})
      for (double p : {0.0, 0.2}) device_equals_host(moe, tie, p, Device::CPU, 1e-5);
}
TEST(Lora, DeviceModelEqualsHostModelOnCuda) {
  Q3VL_NEED_GPU();
  for (bool moe : {false, true})
    for (bool tie : {false, true})
      for (double p : {0.0, 0.2}) device_equals_host(moe, tie, p, Device::CUDA, 1e-4);
}
