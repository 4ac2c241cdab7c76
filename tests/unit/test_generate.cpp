// Generation with the KV cache: greedy decoding equals, token by token, the argmax of a full forward (no cache) over
// the growing sequence, on the HF golden models (dense tied, MoE; all three at int8) and on random tiny models with
// images; the sampler; the training head that skips unsupervised rows. (The engine's batching, which must not change
// answers, is tests/mpi/test_engine.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>

#include "../compare.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/serve/generate.hpp"
#include "q3vl/train/eval.hpp"
#include "../reference/model_io.hpp"

using namespace q3vl;

namespace {

// Prompts = the unpadded rows of a batch; row r's images are the next ones in pixel_values order.
std::vector<GenPrompt> prompts_of(const ModelConfig& cfg, const Batch& b) {
  std::vector<GenPrompt> out;
  const int64_t pd = cfg.vision.patch_dim(), m2 = cfg.vision.merge * cfg.vision.merge;
  size_t img = 0, px = 0;
  for (int r = 0; r < b.B; ++r) {
    GenPrompt p;
    for (int t = 0; t < b.S; ++t)
      if (b.attention_mask.empty() || b.attention_mask[r * b.S + t]) p.ids.push_back(b.input_ids[r * b.S + t]);
    int64_t pads = std::count(p.ids.begin(), p.ids.end(), (int64_t)cfg.image_token_id);
    while (pads > 0) {
      const int64_t* g = &b.image_grid_thw[3 * img++];
      const int64_t n = g[0] * g[1] * g[2];
      p.grid.insert(p.grid.end(), g, g + 3);
      p.pixels.insert(p.pixels.end(), b.pixel_values.begin() + px * pd, b.pixel_values.begin() + (px + n) * pd);
      px += n;
      pads -= n / m2;
    }
    out.push_back(std::move(p));
  }
  return out;
}

SamplingParams greedy(const ModelConfig& cfg, int steps) {
  SamplingParams sp;
  sp.max_new_tokens = steps;
  sp.banned = {cfg.image_token_id, cfg.video_token_id};
  return sp;
}

// Greedy with the cache (the host model's prefill, then a decode step per token over a growing host KV cache) vs.
// argmax of full forwards over prompt + generated so far; also the cached logits vs. the full forward's logits at
// each step.
void check_greedy(Model& model, const std::vector<GenPrompt>& prompts, int steps, const std::string& what) {
  const ModelConfig& cfg = model.config();
  const int64_t V = cfg.text.vocab;
  const SamplingParams sp = greedy(cfg, steps);
  std::vector<std::vector<int64_t>> res(prompts.size());  // each prompt's greedy tokens from the cached logits

  std::vector<std::vector<int64_t>> ids;
  std::vector<float> pixels;
  std::vector<int64_t> grid;
  for (const auto& p : prompts) {
    ids.push_back(p.ids);
    pixels.insert(pixels.end(), p.pixels.begin(), p.pixels.end());
    grid.insert(grid.end(), p.grid.begin(), p.grid.end());
  }
  HostKvCache<float> cache;
  std::vector<int> all(prompts.size());
  std::iota(all.begin(), all.end(), 0);
  double worst = 0;
  for (int t = 0; t < steps; ++t) {
    std::vector<float> cached;
    if (t == 0) {
      cached = model.prefill(ids, pixels, grid, cache);
    } else {
      std::vector<int64_t> last;
      for (size_t i = 0; i < prompts.size(); ++i) last.push_back(res[i][t - 1]);
      cached = model.decode(all, last, cache);
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::mt19937_64 unused;
      res[i].push_back(sample_token(&cached[i * V], V, sp, unused));
    }
    // The same sequences right-padded into one batch, no cache.
    Batch b;
    b.B = (int)prompts.size();
    for (size_t i = 0; i < prompts.size(); ++i) b.S = std::max<int>(b.S, (int)prompts[i].ids.size() + t);
    b.input_ids.assign((size_t)b.B * b.S, 0);
    b.attention_mask.assign(b.input_ids.size(), 0);
    b.pixel_values = pixels;
    b.image_grid_thw = grid;
    std::vector<int64_t> lastpos(b.B);
    for (int i = 0; i < b.B; ++i) {
      std::vector<int64_t> seq = prompts[i].ids;
      seq.insert(seq.end(), res[i].begin(), res[i].begin() + t);
      for (size_t k = 0; k < seq.size(); ++k) b.input_ids[i * b.S + k] = seq[k], b.attention_mask[i * b.S + k] = 1;
      lastpos[i] = (int64_t)seq.size() - 1;
    }
    std::vector<float> full;
    model.forward(b, false, &full);
    for (int i = 0; i < b.B; ++i) {
      const float* f = &full[(i * b.S + lastpos[i]) * V];
      std::mt19937_64 unused;
      EXPECT_EQ(res[i][t], sample_token(f, V, sp, unused)) << what << ": prompt " << i << " step " << t;
      worst = std::max(worst, test::rel_max_diff(std::span(cached).subspan(i * V, V), std::span(f, V)));  // NaN: +inf
    }
  }
  EXPECT_LE(worst, 1e-4) << what << ": cached vs. full logits, max |diff| / max |logit|";
  std::printf("[ generate ] %s: %d greedy steps x %zu prompts match; cached logits rel. diff %.2e\n", what.c_str(),
              steps, prompts.size(), worst);
}

// low: the model's weights converted (model.weight_dtype = "int8", "bf16", "fp16"), cached and full passes on the
// same converted weights.
void check_golden(const std::string& name, std::optional<LowDtype> low = {}) {
  const std::string dir = "tests/data/golden/" + name;
  const ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model model(cfg);
  load_hf_weights(model, dir + "/model");
  if (low) model.lower_weights(*low);
  const Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  check_greedy(model, prompts_of(cfg, batch), 10, name + (low ? std::string(" ") + low_dtype_name(*low) : ""));
}

ModelConfig tiny(bool moe) {
  ModelConfig c;
  c.vision.depth = 2;
  c.vision.hidden = 32;
  c.vision.intermediate = 48;
  c.vision.heads = 2;
  c.vision.num_position_embeddings = 16;
  c.vision.out_hidden = 32;
  c.vision.deepstack_indexes = {0, 1};
  c.text.vocab = 64;
  c.text.hidden = 32;
  c.text.intermediate = 40;
  c.text.layers = 3;
  c.text.heads = 4;
  c.text.kv_heads = 2;
  c.text.head_dim = 8;
  c.text.mrope_section = {2, 1, 1};
  c.text.rope_theta = 10000;
  c.text.tie_embeddings = !moe;
  if (moe) {
    c.text.num_experts = 4;
    c.text.experts_per_tok = 2;
    c.text.moe_intermediate = 16;
  }
  c.image_token_id = 60;
  c.video_token_id = 61;
  c.vision_start_token_id = 58;
  c.vision_end_token_id = 59;
  c.eos_token_id = 62;
  return c;
}

// Three prompts: two images of different grids, one image, text only.
std::vector<GenPrompt> tiny_prompts() {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto image = [&](GenPrompt& p, int64_t h, int64_t w) {
    p.ids.push_back(58);
    p.ids.insert(p.ids.end(), h * w / 4, 60);
    p.ids.push_back(59);
    p.grid.insert(p.grid.end(), {1, h, w});
    for (int64_t i = 0; i < h * w * 1536; ++i) p.pixels.push_back(nd(rng));
  };
  std::vector<GenPrompt> ps(3);
  ps[0].ids = {1, 2};
  image(ps[0], 4, 4);
  ps[0].ids.insert(ps[0].ids.end(), {3, 4});
  image(ps[0], 2, 6);
  ps[0].ids.push_back(5);
  ps[1].ids = {7};
  image(ps[1], 6, 2);
  ps[1].ids.insert(ps[1].ids.end(), {8, 9, 10, 11});
  ps[2].ids = {12, 13, 14, 15, 16, 17, 18, 19, 20};
  return ps;
}

}  // namespace

TEST(Generate, GreedyEqualsFullForwardArgmaxGoldenDense) { check_golden("dense_tied"); }
TEST(Generate, GreedyEqualsFullForwardArgmaxGoldenMoe) { check_golden("moe"); }
// The int8 paths of prefill/decode (the head's rows, the tied embedding's rows, the experts) agree with forward's.
TEST(Generate, Int8GreedyEqualsFullForwardArgmaxGolden) {
  for (const char* c : {"dense_tied", "dense_untied", "moe"}) check_golden(c, LowDtype::I8);
}
// bf16/fp16 weights widened by the same products: the tied embedding's and the experts' rows in 16 bits.
TEST(Generate, HalfWeightsGreedyEqualsFullForwardArgmaxGolden) {
  for (const char* c : {"dense_tied", "moe"}) check_golden(c, LowDtype::BF16);
  check_golden("dense_untied", LowDtype::F16);
}

TEST(Generate, GreedyEqualsFullForwardArgmaxTinyImages) {
  for (bool moe : {false, true}) {
    Model m(tiny(moe));
    m.init_random(11, 0.5);  // large weights: peaked logits, so the argmax is not a near-tie
    check_greedy(m, tiny_prompts(), 12, moe ? "tiny moe" : "tiny dense");
  }
}

TEST(Generate, DecodeRefusesImageTokens) {
  Model m(tiny(false));
  m.init_random(3, 0.5);
  HostKvCache<float> cache;
  m.prefill({{1, 2, 3}}, {}, {}, cache);
  EXPECT_EQ(cache.len[0], 3);
  EXPECT_EQ(cache.next_pos[0], 3);
  EXPECT_THROW(m.decode({0}, {60}, cache), Error);
  EXPECT_THROW(m.decode({1}, {5}, cache), Error);
}

TEST(Generate, RopeDeltasContinueAfterTheLargestPosition) {
  // One text token, an image of merged grid 3x1 (6x2 patches), one text token: 5 tokens, but positions run to 4.
  Model m(tiny(false));
  m.init_random(3, 0.5);
  HostKvCache<float> cache;
  GenPrompt p;
  p.ids = {7, 60, 60, 60, 8};
  p.grid = {1, 6, 2};
  p.pixels.assign(12 * 1536, 0.1f);
  m.prefill({p.ids}, p.pixels, p.grid, cache);
  // Image at cur = 1: rows (T, H, W) = (1, 1..3, 1); cur = 1 + max(1, 3, 1) = 4; token 8 gets 4; next is 5.
  EXPECT_EQ(cache.next_pos[0], 5);
  m.decode({0}, {9}, cache);
  EXPECT_EQ(cache.next_pos[0], 6);
  EXPECT_EQ(cache.len[0], 6);
}

// serve's path: prompts fed in chunks that straddle images, mixed in one step with another sequence's decoding, over
// a paged cache of small blocks (a released slot and its blocks reused) == prefill + decode.
TEST(Generate, StepChunksOverPagedCacheEqualPrefillAndDecode) {
  Model m(tiny(false));
  m.init_random(5, 0.5);
  const int64_t V = 64, H = 32;
  std::vector<GenPrompt> ps(2);
  ps[0].ids = {7, 60, 60, 60, 8, 9};
  ps[1].ids = {5, 6, 60, 60, 60, 9, 10, 11, 12};
  for (auto& p : ps) {
    p.grid = {1, 6, 2};
    for (int i = 0; i < 12 * 1536; ++i) p.pixels.push_back(std::sin(0.01f * i + (float)p.ids[0]));
  }
  HostKvCache<float> ref;
  std::vector<float> pixels = ps[0].pixels;
  pixels.insert(pixels.end(), ps[1].pixels.begin(), ps[1].pixels.end());
  const std::vector<float> l0 = m.prefill({ps[0].ids, ps[1].ids}, pixels, {1, 6, 2, 1, 6, 2}, ref);
  const std::vector<float> l1 = m.decode({0, 1}, {3, 4}, ref);

  HostKvCache<float> c;
  c.block = 2;
  c.max_blocks = 16;
  c.reset(3, 2 * 8);
  const int junk = c.add();  // a sequence that comes and goes first: its slot and blocks are reused
  ASSERT_TRUE(c.reserve(junk, 7));
  c.release(junk);
  std::vector<int> slot;
  std::vector<std::vector<int64_t>> pos;
  std::vector<std::vector<float>> img(2);
  std::vector<std::vector<std::vector<float>>> ds(2);
  std::vector<int64_t> fed(2, 0), vis(2, 0);
  for (int i = 0; i < 2; ++i) {
    slot.push_back(c.add());
    const int64_t n = (int64_t)ps[i].ids.size();
    pos.push_back(mrope_positions(m.config(), ps[i].ids.data(), {0, n}, ps[i].grid));
    m.vision_features(ps[i].pixels, ps[i].grid, img[i], ds[i]);
    for (int64_t p : pos[i]) c.next_pos[slot[i]] = std::max(c.next_pos[slot[i]], p + 1);
  }
  EXPECT_EQ(slot[0], junk);
  auto chunk = [&](int i, int64_t k) {
    const int64_t n = (int64_t)ps[i].ids.size(), a = fed[i], b = a + k;
    StepSegment<float> g;
    g.seq = slot[i];
    g.ids.assign(ps[i].ids.begin() + a, ps[i].ids.begin() + b);
    for (int row = 0; row < 3; ++row) g.pos3.insert(g.pos3.end(), pos[i].begin() + row * n + a, pos[i].begin() + row * n + b);
    const int64_t nv = std::count(g.ids.begin(), g.ids.end(), 60);
    g.img.assign(img[i].begin() + vis[i] * H, img[i].begin() + (vis[i] + nv) * H);
    for (const auto& d : ds[i]) g.ds.emplace_back(d.begin() + vis[i] * H, d.begin() + (vis[i] + nv) * H);
    vis[i] += nv, fed[i] = b;
    return g;
  };
  auto near = [&](const float* a, const float* b, const std::string& what) {
    for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(a[v], b[v], 1e-5) << what << " logit " << v;
  };
  m.step({chunk(0, 2)}, c);                                   // prompt 0: its first token and an image token
  std::vector<float> l = m.step({chunk(0, 4), chunk(1, 3)}, c);  // prompt 0 done; prompt 1 into its image
  near(&l[0], &l0[0], "prompt 0");
  l = m.step({StepSegment<float>{slot[0], {3}, {}, {}, {}}, chunk(1, 6)}, c);  // decode 0 while prompt 1 finishes
  near(&l[0], &l1[0], "decode 0");
  near(&l[V], &l0[V], "prompt 1");
  l = m.step({StepSegment<float>{slot[1], {4}, {}, {}, {}}}, c);
  near(&l[0], &l1[V], "decode 1");
  EXPECT_EQ(c.len[slot[0]], 7);
  EXPECT_EQ(c.len[slot[1]], 10);
  EXPECT_EQ(c.used_blocks(), 4 + 5);
  c.release(slot[1]);
  EXPECT_EQ(c.used_blocks(), 4);
  // A full pool refuses, and step names it.
  const int big = c.add();
  EXPECT_FALSE(c.reserve(big, 2 * 13));
  EXPECT_THROW(m.step({StepSegment<float>{big, std::vector<int64_t>(26, 5), {}, {}, {}}}, c), Error);
}

// serve's prefix cache: a sequence that starts with another's full blocks and computes only its own tail gets the
// logits of computing everything; the blocks live while anyone holds them.
TEST(Generate, SharedPrefixBlocksEqualComputingThem) {
  Model m(tiny(false));
  m.init_random(5, 0.5);
  const int64_t V = 64;
  const std::vector<int64_t> ids = {7, 3, 9, 11, 2, 5, 6, 1, 4};
  const int64_t n = (int64_t)ids.size();
  const std::vector<int64_t> pos = mrope_positions(m.config(), ids.data(), {0, n}, {});
  auto seg = [&](int s, int64_t a, int64_t b) {
    StepSegment<float> g;
    g.seq = s;
    g.ids.assign(ids.begin() + a, ids.begin() + b);
    for (int row = 0; row < 3; ++row) g.pos3.insert(g.pos3.end(), pos.begin() + row * n + a, pos.begin() + row * n + b);
    return g;
  };
  HostKvCache<float> c;
  c.block = 2;
  c.max_blocks = 12;
  c.reset(3, 2 * 8);
  const int a = c.add();
  ASSERT_TRUE(c.reserve(a, n));
  const std::vector<float> full = m.step({seg(a, 0, n)}, c);
  const std::vector<int32_t> prefix(c.table[a].begin(), c.table[a].begin() + 3);  // 6 tokens
  const int b = c.add();
  c.share(b, prefix);
  EXPECT_EQ(c.len[b], 6);
  const std::vector<float> tail = m.step({seg(b, 6, n)}, c);
  for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(tail[v], full[v], 1e-5) << "logit " << v;
  EXPECT_EQ(c.used_blocks(), 5 + 2);  // b's own: tokens 6..8
  c.release(a);
  EXPECT_EQ(c.used_blocks(), 3 + 2);  // the shared blocks stay with b
  c.hold(prefix[0]);
  c.release(b);
  EXPECT_EQ(c.used_blocks(), 1);
  c.drop(prefix[0]);
  EXPECT_EQ(c.used_blocks(), 0);
  EXPECT_THROW(c.drop(prefix[0]), Error);
  const int d = c.add();
  EXPECT_THROW(c.share(d, {prefix[1]}), Error);  // freed: nothing to share
}

TEST(Sampler, GreedyTopKTopPAndSeeds) {
  const std::vector<float> l = {0.f, 3.f, 1.f, 3.f, 2.f, -1.f};
  SamplingParams sp;
  std::mt19937_64 rng(1);
  EXPECT_EQ(sample_token(l.data(), 6, sp, rng), 1) << "ties go to the lower id";
  sp.banned = {1};
  EXPECT_EQ(sample_token(l.data(), 6, sp, rng), 3);
  sp.vocab_limit = 3;
  EXPECT_EQ(sample_token(l.data(), 6, sp, rng), 2);
  sp = SamplingParams{};
  sp.temperature = 1;
  sp.top_k = 1;
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sample_token(l.data(), 6, sp, rng), 1);
  sp.top_k = 0;
  sp.top_p = 0.3;  // the two tied tokens hold about 0.37 each: only the first is kept
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sample_token(l.data(), 6, sp, rng), 1);
  // Full sampling: frequencies follow softmax, the same seed gives the same draws.
  sp.top_p = 1;
  std::vector<int> count(6, 0);
  std::mt19937_64 a(7), b(7);
  for (int i = 0; i < 20000; ++i) {
    const int64_t t = sample_token(l.data(), 6, sp, a);
    ++count[t];
    EXPECT_EQ(t, sample_token(l.data(), 6, sp, b));
  }
  double z = 0;
  for (float v : l) z += std::exp(v);
  for (int v = 0; v < 6; ++v) EXPECT_NEAR(count[v] / 20000.0, std::exp(l[v]) / z, 0.015) << "token " << v;
  // top_k = 2 at high temperature: only the two best.
  sp.top_k = 2;
  sp.temperature = 50;
  for (int i = 0; i < 200; ++i) {
    const int64_t t = sample_token(l.data(), 6, sp, a);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
}

// top_p over a vocabulary whose nucleus is far longer than the first head sample_token sorts (64): the kept ids must
// be exactly the sorted prefix a full sort gives, whatever number of rounds finds it.
TEST(Sampler, TopPNucleusEqualsAFullSort) {
  const int64_t V = 3000;
  std::mt19937 g(5);
  std::uniform_real_distribution<float> u(0.f, 0.5f);
  std::vector<float> l(V);
  for (float& v : l) v = u(g);
  for (double top_p : {0.02, 0.5, 0.97}) {
    std::vector<int64_t> ids(V);
    std::iota(ids.begin(), ids.end(), 0);
    std::sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    double sum = 0, mass = 0;
    for (float v : l) sum += std::exp(double(v - l[ids[0]]));  // as sample_token rounds it
    std::set<int64_t> nucleus;
    for (int64_t v : ids) {
      if (!nucleus.empty() && mass >= top_p * sum) break;
      mass += std::exp(double(l[v] - l[ids[0]])), nucleus.insert(v);
    }
    SamplingParams sp;
    sp.temperature = 1, sp.top_p = top_p;
    std::mt19937_64 rng(11);
    std::set<int64_t> seen;
    const int draws = 8000;
    for (int i = 0; i < draws; ++i) {
      const int64_t t = sample_token(l.data(), V, sp, rng);
      ASSERT_TRUE(nucleus.count(t)) << "top_p " << top_p << ": token " << t << " is outside the nucleus of "
                                    << nucleus.size();
      seen.insert(t);
    }
    // Nearly flat probabilities: draws reach about 1 - exp(-draws / size) of the nucleus.
    const double n = double(nucleus.size());
    EXPECT_GE(double(seen.size()), 0.9 * n * (1 - std::exp(-draws / n))) << "top_p " << top_p;
  }
}

TEST(LmHead, SkippingUnsupervisedRowsKeepsTheLoss) {
  Model m(tiny(false));
  m.init_random(4, 0.3);
  const auto ps = tiny_prompts();
  Batch b;
  b.B = 1;
  b.input_ids = ps[0].ids;
  b.S = (int)b.input_ids.size();
  b.labels.assign(b.S, -100);
  for (int t = b.S - 4; t < b.S; ++t) b.labels[t] = b.input_ids[t];  // a few supervised targets at the end
  b.pixel_values = ps[0].pixels;
  b.image_grid_thw = ps[0].grid;
  std::vector<float> logits;
  const double with = m.forward(b, false, &logits);
  const double without = m.forward(b, false);
  EXPECT_NEAR(with, without, 1e-6 * std::fabs(with));
  EXPECT_EQ(m.supervised_tokens(), 4);
}
