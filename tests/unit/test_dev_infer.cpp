// Serving on the device model (DevModel::step / vision_features over a paged KV cache on the device) against the host
// model's (BasicModel::step), on the three transformers-initialised golden models (dense tied, dense untied, MoE):
// two prompts with an image each, fed in chunks that end mid-image and mid-block, one decoding while the other is
// still in its prompt, then greedy decoding of both; every step's logits compared. The pool is shuffled by a sequence
// that comes and goes first, so block tables are not the identity. On the CPU (fp32) the device path is the CPU op
// layer: it runs in CI; on CUDA in fp32, bf16 and fp16 (make test-gpu).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <cmath>
#include <cstdio>
#include <random>

#include "../compare.hpp"
#include "../gpu.hpp"
#include "../q8_ref.hpp"
#include "q3vl/core/deck.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/io/checkpoint.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/model/dev_model.hpp"
#include "../reference/layers.hpp"
#include "q3vl/serve/generate.hpp"
#include "q3vl/serve/tp.hpp"
#include "q3vl/tensor/ops.hpp"
#include "../reference/model_io.hpp"

using namespace q3vl;

namespace {

// The reference's margin (its best logit minus its logit of the device's pick, over its max |logit|) of the first row
// of a step's logits [rows, V] where the two argmaxes differ and that margin is within `bound`; -1 when none does.
double flipped_near_tie(const std::vector<float>& got, const std::vector<float>& ref, int64_t V, double bound) {
  const double scale = test::max_abs(ref);
  for (size_t r = 0; r + size_t(V) <= ref.size(); r += size_t(V)) {
    const auto a = std::max_element(ref.begin() + long(r), ref.begin() + long(r + V)) - ref.begin();
    const auto b = std::max_element(got.begin() + long(r), got.begin() + long(r + V)) - got.begin();
    const double m = (double(ref[size_t(a)]) - ref[size_t(b)]) / scale;
    if (a != b && m <= bound) return m;
  }
  return -1;
}

struct Prompt {
  std::vector<int64_t> ids, pos;  // pos [3][n]
  std::vector<int64_t> grid;
  std::vector<float> pixels;
};

// Text ids around one image of grid [1, gh, gw]: vision start, the image tokens, vision end.
Prompt make_prompt(const ModelConfig& cfg, int64_t gh, int64_t gw, int pre, int post, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> tok(1, std::min<int64_t>(cfg.text.vocab, 240) - 1);
  std::normal_distribution<float> px(0.f, 1.f);
  Prompt p;
  for (int i = 0; i < pre; ++i) p.ids.push_back(tok(rng));
  p.ids.push_back(cfg.vision_start_token_id);
  p.ids.insert(p.ids.end(), gh * gw / (cfg.vision.merge * cfg.vision.merge), cfg.image_token_id);
  p.ids.push_back(cfg.vision_end_token_id);
  for (int i = 0; i < post; ++i) p.ids.push_back(tok(rng));
  p.grid = {1, gh, gw};
  p.pixels.resize(size_t(gh * gw * cfg.vision.patch_dim()));
  for (float& v : p.pixels) v = px(rng);
  const int64_t n = int64_t(p.ids.size());
  p.pos = mrope_positions(cfg, p.ids.data(), {0, n}, p.grid);
  return p;
}

// The logits of every step of one schedule, through either model.
struct Runner {
  std::function<std::vector<float>(const std::vector<StepSegment<float>>&, KvCache&)> step;
  std::function<void(const Prompt&, std::vector<float>&, std::vector<std::vector<float>>&)> vision;
};

std::vector<std::vector<float>> schedule(const ModelConfig& cfg, const std::vector<Prompt>& ps, KvCache& c,
                                         const Runner& r, std::vector<std::vector<int64_t>>& greedy, bool record,
                                         std::vector<std::vector<float>>* img_out) {
  const int64_t H = cfg.text.hidden, V = cfg.text.vocab;
  const int junk = c.add();  // comes and goes first: its slot and (shuffled) blocks are reused
  EXPECT_TRUE(c.reserve(junk, 3 * c.block + 1));
  c.release(junk);
  std::vector<int> slot;
  std::vector<std::vector<float>> img(ps.size());
  std::vector<std::vector<std::vector<float>>> ds(ps.size());
  std::vector<int64_t> fed(ps.size(), 0), vis(ps.size(), 0);
  for (size_t i = 0; i < ps.size(); ++i) {
    slot.push_back(c.add());
    r.vision(ps[i], img[i], ds[i]);
    for (int64_t p : ps[i].pos) c.next_pos[slot[i]] = std::max(c.next_pos[slot[i]], p + 1);
  }
  if (img_out) *img_out = img;
  auto chunk = [&](size_t i, int64_t k) {
    const int64_t n = int64_t(ps[i].ids.size()), a = fed[i], b = std::min(n, a + k);
    StepSegment<float> g;
    g.seq = slot[i];
    g.ids.assign(ps[i].ids.begin() + a, ps[i].ids.begin() + b);
    for (int row = 0; row < 3; ++row)
      g.pos3.insert(g.pos3.end(), ps[i].pos.begin() + row * n + a, ps[i].pos.begin() + row * n + b);
    const int64_t nv = std::count(g.ids.begin(), g.ids.end(), int64_t(cfg.image_token_id));
    g.img.assign(img[i].begin() + vis[i] * H, img[i].begin() + (vis[i] + nv) * H);
    if (nv)
      for (const auto& d : ds[i]) g.ds.emplace_back(d.begin() + vis[i] * H, d.begin() + (vis[i] + nv) * H);
    vis[i] += nv, fed[i] = b;
    return g;
  };
  auto decode = [&](size_t i, size_t t) { return StepSegment<float>{slot[i], {greedy[i][t]}, {}, {}, {}}; };
  auto argmax = [&](const std::vector<float>& l, int64_t row) {  // never a vision token (random weights may pick one)
    int64_t best = -1;
    for (int64_t v = 0; v < V; ++v) {
      if (v == cfg.image_token_id || v == cfg.video_token_id || v == cfg.vision_start_token_id ||
          v == cfg.vision_end_token_id)
        continue;
      if (best < 0 || l[size_t(row * V + v)] > l[size_t(row * V + best)]) best = v;
    }
    return best;
  };
  std::vector<std::vector<float>> out;
  auto run = [&](const std::vector<StepSegment<float>>& segs) {  // the blocks reserved first, as the engine does
    for (const auto& g : segs) EXPECT_TRUE(c.reserve(g.seq, int64_t(g.ids.size())));
    out.push_back(r.step(segs, c));
    return out.back();
  };
  run({chunk(0, 5)});                            // prompt 0 into its image
  if (ps.size() == 1) {  // one sequence: the rest of its prompt, then one-row decode steps
    std::vector<float> l = run({chunk(0, 100)});
    for (size_t t = 0; t < 6; ++t) {
      if (record) greedy[0].push_back(argmax(l, 0));
      l = run({decode(0, t)});
    }
    return out;
  }
  std::vector<float> l = run({chunk(0, 100), chunk(1, 7)});  // prompt 0 done, prompt 1 mid-image
  if (record) greedy[0].push_back(argmax(l, 0));
  l = run({decode(0, 0), chunk(1, 100)});        // decode 0 while prompt 1 finishes
  if (record) greedy[0].push_back(argmax(l, 0)), greedy[1].push_back(argmax(l, 1));
  for (size_t t = 1; t < 6; ++t) {
    l = run({decode(0, t), decode(1, t - 1)});
    if (record) greedy[0].push_back(argmax(l, 0)), greedy[1].push_back(argmax(l, 1));
  }
  return out;
}

// Every step within tol, the MoE model's in bf16 too: the router runs in fp32 (dev_decoder.cpp), so bf16's rounding no
// longer flips a token's top-k experts (it did, one decode step of eight, with the router's logits in bf16).
// splits: pipeline stage boundaries (serve.pp): the device model as a chain of stages, each holding its layers'
// units only, the hidden states passed on through the host as serve passes them between ranks.
// quant (int8, fp8): the device model holds its quant_param linears (the MoE model's experts too) in that format; the
// host reference computes with those matrices quantized and dequantized again (ops::quantize_rows, the same rows), so
// only the arithmetic differs.
// graphs: decode steps padded to a bucket of segments (the schedule's two decoding sequences become four), and on a
// GPU recorded once as a graph that the later decode steps replay with new tokens, positions and block tables.
// nan_step: that step's device logits replaced by NaN before the comparison (the check's own test).
// name "MODEL:hd64": the golden model's shape with head dim 64, intermediate size 128 and the experts' 256 (the decode
// chain's attention link, chain_attn.cuh, takes head dims 64 and 128, the goldens' is 16; the chain kernel 128-byte
// rows, bf16 rows of 96 are not; its MoE link four such rows an expert) and random weights: bf16 decode steps of the
// dense model run both layers as one chain kernel. one: the first prompt alone (one-row decode steps).
void infer_case(const std::string& name, Device d, DType dt, double tol, std::vector<int> splits = {},
                QFormat quant = QFormat::None, bool graphs = false, int nan_step = -1, bool one = false) {
  const bool hd64 = name.ends_with(":hd64");
  const std::string dir = "tests/data/golden/" + name.substr(0, name.find(':')) + "/model";
  ModelConfig cfg = load_hf_config(dir + "/config.json");
  if (hd64) {
    cfg.text.head_dim = 64, cfg.text.intermediate = 128, cfg.text.moe_intermediate = 256;
    for (int& s : cfg.text.mrope_section) s *= 4;  // the rotary columns: hd / 2
  }
  Model host(cfg);
  if (hd64) host.init_random(5, 0.08);
  else load_hf_weights(host, dir);
  const std::vector<float> original(host.params(), host.params() + host.table().total());
  const bool q8 = quant != QFormat::None;
  if (q8) {
    const auto [quantized, experts] = test::dequantize_q8_params(host, quant);
    EXPECT_GT(quantized, 0);
    int moe = 0;
    for (int l = 0; l < cfg.text.layers; ++l) moe += host.table().moe_layer(l);
    EXPECT_EQ(experts, 2 * moe) << "every MoE layer's gate_up and down";
  }
  std::vector<Prompt> ps{make_prompt(cfg, 4, 4, 3, 9, 1), make_prompt(cfg, 4, 8, 6, 5, 2)};
  if (one) ps.pop_back();  // one sequence: one-row decode steps
  const int64_t block = 4, blocks = 24;

  HostKvCache<float> hc;
  hc.block = block, hc.max_blocks = blocks;
  hc.reset(cfg.text.layers, int64_t(cfg.text.kv_heads) * cfg.text.head_dim);
  std::vector<std::vector<int64_t>> greedy(2);
  std::vector<std::vector<float>> himg;
  const Runner hr{[&](const std::vector<StepSegment<float>>& s, KvCache&) { return host.step(s, hc); },
                  [&](const Prompt& p, std::vector<float>& img, std::vector<std::vector<float>>& ds) {
                    host.vision_features(p.pixels, p.grid, img, ds);
                  }};
  const auto ref = schedule(cfg, ps, hc, hr, greedy, true, &himg);

  dev::Exec ex = dev::make_exec(d);
  std::vector<std::vector<float>> got, dimg;
  {
    std::vector<int> cut{0};
    cut.insert(cut.end(), splits.begin(), splits.end());
    cut.push_back(cfg.text.layers);
    std::vector<std::unique_ptr<DevModel>> st;  // the stages, in order (one: the whole model)
    for (size_t k = 0; k + 1 < cut.size(); ++k) {
      const DevStage g{cut[k], k + 2 == cut.size() ? -1 : cut[k + 1], k == 0, k + 2 == cut.size()};
      st.push_back(std::make_unique<DevModel>(cfg, ex, dt, /*grads=*/false, g, quant));
      st.back()->set_params(original.data());
      if (q8) {
        EXPECT_LT(st.back()->memory().weights, DevModel::weight_bytes(ParamTable(cfg), dt, g));
        EXPECT_EQ(st.back()->memory().weights, DevModel::weight_bytes(ParamTable(cfg), dt, g, quant));
      }
      st.back()->reserve_infer({/*tokens=*/32, /*segments=*/4, /*patches=*/64, blocks, block, /*seq_blocks=*/12});
      st.back()->set_graphs(graphs);
      if (st.size() > 1) {
        EXPECT_LT(st.back()->memory().weights, DevModel::weight_bytes(ParamTable(cfg), dt));
      }
    }
    KvCache dc;
    dc.block = block, dc.max_blocks = blocks;
    dc.reset();
    const Runner dr{[&](const std::vector<StepSegment<float>>& s, KvCache& c) {
                      // Every stage keeps the same bookkeeping (serve: each rank replays it): a copy per stage.
                      std::vector<float> x, y, out;
                      const KvCache before = c;
                      for (size_t k = 0; k < st.size(); ++k) {
                        KvCache mine = before;
                        KvCache& use = k == 0 ? c : mine;
                        out = st[k]->step(s, use, k ? &x : nullptr, &y);
                        x.swap(y);
                      }
                      return out;
                    },
                    [&](const Prompt& p, std::vector<float>& img, std::vector<std::vector<float>>& ds) {
                      st[0]->vision_features(p.pixels, p.grid, img, ds);
                    }};
    got = schedule(cfg, ps, dc, dr, greedy, false, &dimg);
    EXPECT_EQ(dc.used_blocks(), hc.used_blocks());
    for (auto& m : st)  // one bucket (two sequences padded to four), recorded once, replayed by the later steps
      EXPECT_EQ(m->graphs_recorded(), graphs && d == Device::CUDA ? 1 : 0);
    // Budgets are enforced with a message, not overrun.
    const int big = dc.add();
    std::vector<float> sink;
    EXPECT_THROW(st[0]->step({StepSegment<float>{big, std::vector<int64_t>(33, 5), {}, {}, {}}}, dc, nullptr, &sink),
                 Error);
  }
  dev::destroy_exec(ex);
  if (nan_step >= 0) std::fill(got.at(nan_step).begin(), got.at(nan_step).end(), NAN);

  double worst_img = 0;
  ASSERT_EQ(himg.size(), dimg.size());
  for (size_t i = 0; i < himg.size(); ++i) worst_img = test::worse(worst_img, test::rel_max_diff(dimg[i], himg[i]));
  EXPECT_LE(worst_img, tol) << "image features";
  ASSERT_EQ(ref.size(), got.size());
  double worst = 0;
  std::string ended;
  // MoE in bf16/fp16: the router reads rounded hidden states, and a token whose top-k is nearly tied can take another
  // expert, which moves its row's logits far (measured on an H200: one step of 8 at 0.38 on the golden MoE model,
  // the others within 2.1e-2). One such step is allowed; bounding it by the reference's router margins instead is
  // issue 34's remaining part.
  int router_ties = cfg.moe() && dt != DType::F32 ? 1 : 0;
  for (size_t s = 0; s < ref.size(); ++s) {
    ASSERT_EQ(ref[s].size(), got[s].size()) << "step " << s;
    const double e = test::rel_max_diff(got[s], ref[s]);  // +inf for NaN or Inf
    if (e > tol && e != test::kNonFinite && router_ties-- > 0) {
      ended += ", step " + std::to_string(s) + " at " + std::to_string(e) + " (a routing near-tie)";
      continue;
    }
    EXPECT_LE(e, tol) << name << ": step " << s << (e == test::kNonFinite ? " has NaN or Inf logits" : "");
    worst = std::max(worst, e);
    if (!(e <= tol)) break;
    // Greedy decoding: where the reference's two best logits are closer than the comparison's own bound, the device
    // may pick the other within it; its later steps then continue another text and are not comparable. Only such a
    // measured near-tie ends the comparison (a larger margin flipped fails at the next step's bound).
    if (const double m = flipped_near_tie(got[s], ref[s], cfg.text.vocab, 2 * tol); m >= 0) {
      ended = ", a near-tie flipped at step " + std::to_string(s) + " (margin " + std::to_string(m) + " of max|logit|)";
      break;
    }
  }
  std::printf("  %s%s%s%s on %s %s: %zu steps, logits max|diff|/max|logit| %.2e (bound %.0e), image features %.2e%s\n",
              name.c_str(), q8 ? (std::string(" ") + qformat_name(quant)).c_str() : "", graphs ? " padded decode" : "",
              splits.empty() ? "" : (" in " + std::to_string(splits.size() + 1) + " stages").c_str(),
              d == Device::CUDA ? "cuda" : "cpu", dtype_name(dt), ref.size(), worst, tol, worst_img, ended.c_str());
}

}  // namespace

TEST(DevInfer, StepMatchesHostOnCpu) {
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CPU, DType::F32, 1e-5);
}
// The comparison fails on NaN: a device model that returned one decode step of NaN logits fails (before, max|diff|
// over NaN read as 0 and passed).
TEST(DevInfer, NanLogitsFail) {
  const auto failures =
      test::failures_of([] { infer_case("dense_tied", Device::CPU, DType::F32, 1e-5, {}, QFormat::None, false, 4); });
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("dense_tied: step 4 has NaN or Inf logits"), std::string::npos) << failures[0];
}
// serve.pp: the same steps through pipeline stages (the MoE model's DeepStack layer 1 on the second stage; the
// untied model in three stages of one layer each; the tied model's embeddings on the first and last stage).
TEST(DevInfer, PipelineStagesMatchHostOnCpu) {
  infer_case("dense_tied", Device::CPU, DType::F32, 1e-5, {1});
  infer_case("dense_untied", Device::CPU, DType::F32, 1e-5, {1, 2});
  infer_case("moe", Device::CPU, DType::F32, 1e-5, {1});
}
TEST(DevInfer, PipelineStagesMatchHostOnCuda) {
  Q3VL_NEED_GPU();
  infer_case("dense_untied", Device::CUDA, DType::F32, 1e-4, {1, 2});
  infer_case("moe", Device::CUDA, DType::BF16, 3e-2, {1});
}
// model.weight_dtype = "int8" or "fp8" on the device model: q/k/v/o, dense gate/up/down, MoE experts and an untied
// head in that format.
void q8_on_cpu(QFormat f) {
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CPU, DType::F32, 1e-5, {}, f);
  infer_case("dense_untied", Device::CPU, DType::F32, 1e-5, {1}, f);
  infer_case("moe", Device::CPU, DType::F32, 1e-5, {1}, f);
}
void q8_on_cuda(QFormat f) {
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CUDA, DType::F32, 1e-4, {}, f);
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CUDA, DType::BF16, 3e-2, {}, f);
}
TEST(DevInfer, Int8MatchesQuantizedHostOnCpu) { q8_on_cpu(QFormat::Int8); }
TEST(DevInfer, Fp8MatchesQuantizedHostOnCpu) { q8_on_cpu(QFormat::Fp8); }
TEST(DevInfer, Int8MatchesQuantizedHostOnCuda) {
  Q3VL_NEED_GPU();
  q8_on_cuda(QFormat::Int8);
}
TEST(DevInfer, Fp8MatchesQuantizedHostOnCuda) {
  Q3VL_NEED_GPU();
  q8_on_cuda(QFormat::Fp8);
}
// model.cuda_graphs: padded decode steps on the CPU op layer; recorded and replayed as CUDA graphs on a GPU.
TEST(DevInfer, PaddedDecodeMatchesHostOnCpu) {
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CPU, DType::F32, 1e-5, {}, QFormat::None, true);
  infer_case("moe", Device::CPU, DType::F32, 1e-5, {1}, QFormat::Int8, true);
  infer_case("moe", Device::CPU, DType::F32, 1e-5, {1}, QFormat::Fp8, true);
}
TEST(DevInfer, DecodeGraphsMatchHostOnCuda) {
  Q3VL_NEED_GPU();
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CUDA, DType::F32, 1e-4, {}, QFormat::None, true);
  infer_case("dense_untied", Device::CUDA, DType::BF16, 3e-2, {1, 2}, QFormat::None, true);
  infer_case("moe", Device::CUDA, DType::BF16, 3e-2, {}, QFormat::Int8, true);
  infer_case("moe", Device::CUDA, DType::BF16, 3e-2, {}, QFormat::Fp8, true);
}
TEST(DevInfer, StepMatchesHostOnCudaFp32) {
  Q3VL_NEED_GPU();
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CUDA, DType::F32, 1e-4);
}
TEST(DevInfer, StepMatchesHostOnCudaBf16) {
  Q3VL_NEED_GPU();
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CUDA, DType::BF16, 3e-2);
}
// Head dim 64 with the attention in the decode chains (dev_chain_attn, the default): decode steps take the chain
// kernel's attention link (both dense layers as one chain; MoE layers, which do not chain, its two ops), in graphs
// too; fp8 weights the dense chain with it. Also without it (Q3VL_CHAIN_ATTN=0).
struct ChainAttnOn {
  explicit ChainAttnOn(bool on = true) : was(std::exchange(dev_chain_attn(), on)) {}
  ~ChainAttnOn() { dev_chain_attn() = was; }
  bool was;
};
TEST(DevInfer, AttentionLinkMatchesHostOnCuda) {
  Q3VL_NEED_GPU();
  {
    ChainAttnOn off(false);
    infer_case("dense_untied:hd64", Device::CUDA, DType::BF16, 3e-2);
  }
  ChainAttnOn on;
  for (const char* n : {"dense_untied:hd64", "moe:hd64"}) infer_case(n, Device::CUDA, DType::BF16, 3e-2);
  infer_case("dense_untied:hd64", Device::CUDA, DType::BF16, 3e-2, {}, QFormat::None, true);
  infer_case("dense_untied:hd64", Device::CUDA, DType::BF16, 3e-2, {}, QFormat::Fp8);
}
TEST(DevInfer, AttentionLinkMatchesHostOnCpu) {
  {
    ChainAttnOn off(false);
    infer_case("dense_untied:hd64", Device::CPU, DType::F32, 1e-5);
  }
  ChainAttnOn on;
  infer_case("dense_untied:hd64", Device::CPU, DType::F32, 1e-5);
  infer_case("moe:hd64", Device::CPU, DType::F32, 1e-5);
}
// The MoE block in the decode chain (dev_chain_moe, one-row steps): on the CPU its link runs the MoE ops; on CUDA in
// bf16 the hd64 shape's one-row decode steps run both MoE layers as one chain kernel (its MoE jobs), the golden
// shape (experts' rows of 64 bytes) the link's ops.
struct ChainMoeOn {
  ChainMoeOn() : was(std::exchange(dev_chain_moe(), true)) {}
  ~ChainMoeOn() { dev_chain_moe() = was; }
  bool was;
};
TEST(DevInfer, MoeLinkMatchesHostOnCpu) {
  ChainMoeOn on;
  for (const char* n : {"moe", "moe:hd64"})
    infer_case(n, Device::CPU, DType::F32, 1e-5, {}, QFormat::None, false, -1, true);
}
TEST(DevInfer, MoeLinkMatchesHostOnCuda) {
  Q3VL_NEED_GPU();
  ChainMoeOn on;
  for (const char* n : {"moe", "moe:hd64"})
    infer_case(n, Device::CUDA, DType::BF16, 3e-2, {}, QFormat::None, false, -1, true);
  infer_case("moe:hd64", Device::CUDA, DType::F32, 1e-4, {}, QFormat::None, false, -1, true);
}
TEST(DevInfer, StepMatchesHostOnCudaFp16) {
  Q3VL_NEED_GPU();
  for (const char* n : {"dense_tied", "dense_untied", "moe"}) infer_case(n, Device::CUDA, DType::F16, 1e-2);
}

// serve's streamed load (one unit at a time, for the device model) gives load_model's weights bitwise: from a model
// directory, a random init, and a training checkpoint.
TEST(StreamWeights, EqualLoadModel) {
  namespace fs = std::filesystem;
  const std::string hf = "tests/data/golden/moe/model", dir = (fs::temp_directory_path() /
                                                                ("q3vl_stream_" + std::to_string(::getpid()))).string();
  // A checkpoint of the golden model with every weight changed, so reading the directory instead would show.
  HostWeights m(load_hf_config(hf + "/config.json"));
  load_hf_weights(m, hf);
  std::vector<float> changed(m.params(), m.params() + m.table().total());
  for (float& v : changed) v = 2 * v + 0.25f;
  std::vector<CkptSlice> slices;
  for (const ParamInfo& p : m.table().params())
    slices.push_back({"model/" + p.name, p.shape, 0, p.numel, changed.data() + m.table().units()[p.unit].offset + p.offset});
  const std::string ck = write_checkpoint(dir, MPI_COMM_WORLD, CkptMeta{5, 0, 1, "", "{}", "test", ""}, slices, 1);
  for (const std::vector<std::string>& ov : std::vector<std::vector<std::string>>{
           {"model.hf=" + hf}, {"model.preset=tiny-moe", "run.seed=7"}, {"model.hf=" + hf, "serve.checkpoint=" + ck}}) {
    const Deck d = Deck::parse("", "test", ov, "serve");
    const ModelSource src = model_source(d, "serve.checkpoint");
    const auto full = load_model(d, src);
    std::vector<float> got(size_t(full->table().total()), -1e30f);
    ASSERT_TRUE(stream_weights(d, src, full->table(), [&](int64_t off, const float* v, int64_t n) {
      std::copy(v, v + n, got.begin() + off);
    }));
    EXPECT_EQ(0, std::memcmp(got.data(), full->params(), got.size() * sizeof(float))) << ov.back();
  }
  fs::remove_all(dir);
}

// A tensor-parallel rank's slice streamed from the source (tp_slices: rows, columns, experts' rows, kv heads shared
// when there are more ranks than kv heads; with serve.ep, sets of whole experts) equals tp_shard_weights's cut of the
// whole model, bitwise; and the cut's experts are the full model's: under serve.ep = P local expert j of rank r is
// expert r / (size / P) * E / P + j, rows [m0, m0 + Im') of its gate and of its up half, columns [m0, m0 + Im') of
// its down_proj, m0 = r % (size / P) * Im'.
TEST(StreamWeights, TensorParallelSlicesEqualSharding) {
  for (const char* preset : {"tiny", "tiny-moe"}) {
    const Deck d = Deck::parse("", "test", {std::string("model.preset=") + preset, "run.seed=3"}, "serve");
    const ModelSource src = model_source(d, "serve.checkpoint");
    const auto full = load_model(d, src);
    const TextConfig& t = full->config().text;
    for (int size : {2, 4})
      for (int ep = 1; ep <= (t.num_experts ? size : 1); ep *= 2)
        for (int rank = 0; rank < size; ++rank) {
          HostWeights cut(tp_config(full->config(), rank, size, ep), false, tp_experts(rank, size, ep));
          tp_shard_weights(*full, cut, rank, size, ep);
          const ParamTable& local = cut.table();
          std::vector<float> got(size_t(local.total()), -1e30f);
          ASSERT_TRUE(stream_weights(
              d, src, local,
              [&](const UnitInfo& u, float* buf) {
                return tp_slices(
                    full->table(), local, rank, size,
                    [&](int id) -> float* {
                      const ParamInfo& p = local.param(id);
                      return &local.units()[p.unit] == &u ? buf + p.offset : nullptr;
                    },
                    ep);
              },
              [&](int64_t off, const float* v, int64_t n) { std::copy(v, v + n, got.begin() + off); }));
          const std::string what = std::string(preset) + " rank " + std::to_string(rank) + " of " +
                                   std::to_string(size) + ", serve.ep = " + std::to_string(ep);
          EXPECT_EQ(0, std::memcmp(got.data(), cut.params(), got.size() * sizeof(float))) << what;
          if (!t.num_experts) continue;
          const int l = 0;  // tiny-moe's MoE layer
          ASSERT_TRUE(full->table().moe_layer(l));
          const int gu = full->table().experts(l), down = gu + 1;
          const int64_t H = t.hidden, Im = t.moe_intermediate, El = t.num_experts / ep, Iml = Im / (size / ep);
          const int64_t e0 = rank / (size / ep) * El, m0 = rank % (size / ep) * Iml;
          ASSERT_EQ(local.param(gu).held, El * 2 * Iml * H) << what;
          for (int64_t j = 0; j < El; ++j)
            for (int64_t r = 0; r < Iml; ++r)
              for (int64_t c = 0; c < H; ++c) {
                const float* fg = full->param(gu) + (e0 + j) * 2 * Im * H;
                const float* lg = cut.param(gu) + j * 2 * Iml * H;
                ASSERT_EQ(lg[r * H + c], fg[(m0 + r) * H + c]) << what << " gate";
                ASSERT_EQ(lg[(Iml + r) * H + c], fg[(Im + m0 + r) * H + c]) << what << " up";
                ASSERT_EQ(cut.param(down)[j * H * Iml + c * Iml + r], full->param(down)[(e0 + j) * H * Im + c * Im + m0 + r])
                    << what << " down";
              }
        }
  }
}

// serve's layout: auto puts pipeline stages across nodes and tensor parallelism within one, tensor parallelism over
// everything otherwise; given keys are taken as they are; a product that is not the rank count fails.
TEST(ServeLayout, AutoAndGiven) {
  auto tp_pp = [](int w, int n, int tp, int pp, int L = 36) {
    const ServeLayout l = serve_layout(w, n, tp, pp, L);
    return std::pair<int, int>{l.tp, l.pp};
  };
  EXPECT_EQ(tp_pp(1, 1, 0, 0), std::make_pair(1, 1));
  EXPECT_EQ(tp_pp(8, 1, 0, 0), std::make_pair(8, 1));          // one node: TP over its GPUs
  EXPECT_EQ(tp_pp(16, 2, 0, 0), std::make_pair(8, 2));         // two nodes of 8: TP 8 within, PP 2 across
  EXPECT_EQ(tp_pp(8, 8, 0, 0, 4), std::make_pair(8, 1));       // more nodes than layers: no stages
  EXPECT_EQ(tp_pp(16, 2, 4, 0), std::make_pair(4, 4));         // serve.tp given: PP fills the rest
  EXPECT_EQ(tp_pp(16, 2, 0, 4), std::make_pair(4, 4));         // serve.pp given: TP fills the rest
  EXPECT_EQ(tp_pp(6, 1, 3, 2), std::make_pair(3, 2));
  EXPECT_NE(serve_layout(16, 2, 0, 0, 36).why.find("layout auto: TP 8 x PP 2"), std::string::npos);
  EXPECT_THROW(serve_layout(3, 1, 0, 2, 36), Error);           // 3 ranks do not split into 2 stages
  EXPECT_THROW(serve_layout(8, 1, 3, 0, 36), Error);
  EXPECT_THROW(serve_layout(8, 1, 4, 4, 36), Error);
  EXPECT_THROW(serve_layout(8, 1, 0, 8, 4), Error);            // more stages than layers
}

// serve.vision_batch: several prompts' images in one pass of the vision tower (one prompt with two images among them)
// give each prompt what a pass of its own gives, to rounding: the attention stays within each image and every other
// op works row by row, but a GEMM's rounding depends on its row count (OpenBLAS takes its small-matrix kernel below
// some size, summing in another order: 7e-7 here; cuBLAS may take another algorithm). Bitwise or not is printed.
void batched_vision_case(Device d, DType dt, double tol) {
  const std::string dir = "tests/data/golden/dense_untied/model";
  const ModelConfig cfg = load_hf_config(dir + "/config.json");
  Model host(cfg);
  load_hf_weights(host, dir);
  std::vector<Prompt> ps{make_prompt(cfg, 4, 4, 3, 9, 1), make_prompt(cfg, 4, 8, 6, 5, 2),
                         make_prompt(cfg, 8, 4, 2, 2, 3)};
  const Prompt extra = make_prompt(cfg, 4, 4, 1, 1, 4);  // prompt 2 gets a second image
  ps[2].grid.insert(ps[2].grid.end(), extra.grid.begin(), extra.grid.end());
  ps[2].pixels.insert(ps[2].pixels.end(), extra.pixels.begin(), extra.pixels.end());
  dev::Exec ex = dev::make_exec(d);
  {
    DevModel m(cfg, ex, dt, /*grads=*/false);
    m.set_params(host.params());
    m.reserve_infer({/*tokens=*/32, /*segments=*/4, /*patches=*/128, /*kv_blocks=*/8, /*block=*/4, /*seq_blocks=*/4});
    const size_t n = ps.size();
    std::vector<std::vector<float>> img1(n), img(n);
    std::vector<std::vector<std::vector<float>>> ds1(n), ds(n);
    std::vector<DevModel::VisionJob> jobs;
    for (size_t i = 0; i < n; ++i) {
      m.vision_features(ps[i].pixels, ps[i].grid, img1[i], ds1[i]);
      jobs.push_back({&ps[i].pixels, &ps[i].grid, &img[i], &ds[i]});
    }
    m.vision_features(jobs);
    bool bitwise = true;
    double worst = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(img[i].size(), img1[i].size()) << "prompt " << i;
      ASSERT_EQ(ds[i].size(), ds1[i].size());
      bitwise = bitwise && img[i] == img1[i] && ds[i] == ds1[i];
      worst = test::worse(worst, test::rel_max_diff(img[i], img1[i]));
      for (size_t j = 0; j < ds[i].size(); ++j) worst = test::worse(worst, test::rel_max_diff(ds[i][j], ds1[i][j]));
    }
    EXPECT_LE(worst, tol);
    std::printf("  batched vision on %s %s: 3 prompts (4 images) in one pass %s a pass each (max rel diff %.2e)\n",
                d == Device::CUDA ? "cuda" : "cpu", dtype_name(dt), bitwise ? "bitwise equal to" : "within tol of",
                worst);
    // Over the patch budget: refused naming it (the engine then encodes job by job).
    jobs.push_back({&ps[1].pixels, &ps[1].grid, &img[0], &ds[0]});
    jobs.push_back({&ps[2].pixels, &ps[2].grid, &img[0], &ds[0]});
    EXPECT_THROW(m.vision_features(jobs), Error);
  }
  dev::destroy_exec(ex);
}
TEST(DevInfer, BatchedVisionMatchesSingleOnCpu) { batched_vision_case(Device::CPU, DType::F32, 1e-5); }
TEST(DevInfer, BatchedVisionMatchesSingleOnCuda) {
  Q3VL_NEED_GPU();
  batched_vision_case(Device::CUDA, DType::F32, 1e-5);
  batched_vision_case(Device::CUDA, DType::BF16, 2e-2);
}
