// Token streams of batches and the packing of a continuous-batching step (model/batch.hpp).
#include "q3vl/model/batch.hpp"

#include <algorithm>

#include "q3vl/core/error.hpp"
#include "q3vl/model/positions.hpp"

namespace q3vl {

TokenStream token_stream(const Batch& b) {
  const size_t n = (size_t)b.B * b.S;
  if (b.input_ids.size() != n) fail("batch: input_ids has " + std::to_string(b.input_ids.size()) + " entries, B*S = " + std::to_string(n));
  if (!b.attention_mask.empty() && b.attention_mask.size() != n) fail("batch: attention_mask size != B*S");
  if (!b.labels.empty() && b.labels.size() != n) fail("batch: labels size != B*S");
  TokenStream s;
  s.cu.push_back(0);
  for (int r = 0; r < b.B; ++r) {
    for (int t = 0; t < b.S; ++t) {
      const size_t i = (size_t)r * b.S + t;
      if (!b.attention_mask.empty() && b.attention_mask[i] == 0) continue;
      s.ids.push_back(b.input_ids[i]);
      s.targets.push_back(!b.labels.empty() && t + 1 < b.S ? b.labels[i + 1] : -100);
      s.orig.push_back((int64_t)i);
    }
    s.cu.push_back((int64_t)s.ids.size());
  }
  s.out_rows = (int64_t)n;
  return s;
}

TokenStream token_stream(const PackedBatch& b) {
  const int64_t N = (int64_t)b.input_ids.size();
  if (b.cu_seqlens.empty() || b.cu_seqlens.front() != 0 || b.cu_seqlens.back() != N)
    fail("packed batch: cu_seqlens must start at 0 and end at the token count " + std::to_string(N));
  if (!b.labels.empty() && (int64_t)b.labels.size() != N) fail("packed batch: labels size != input_ids size");
  TokenStream s;
  s.ids = b.input_ids;
  s.cu = b.cu_seqlens;
  s.targets.assign(N, -100);
  for (size_t k = 0; k + 1 < s.cu.size(); ++k) {
    if (s.cu[k + 1] < s.cu[k]) fail("packed batch: cu_seqlens must be non-decreasing");
    if (!b.labels.empty())
      for (int64_t i = s.cu[k]; i + 1 < s.cu[k + 1]; ++i) s.targets[i] = b.labels[i + 1];
  }
  s.orig.resize(N);
  for (int64_t i = 0; i < N; ++i) s.orig[i] = i;
  s.out_rows = N;
  return s;
}

int64_t image_patches(const VisionConfig& vc, size_t n_pixels, const std::vector<int64_t>& grid) {
  if (grid.size() % 3) fail("image_grid_thw must have 3 entries per image");
  int64_t Np = 0;
  for (size_t i = 0; i < grid.size(); i += 3) {
    if (grid[i] <= 0 || grid[i + 1] % vc.merge || grid[i + 2] % vc.merge || grid[i + 1] <= 0 || grid[i + 2] <= 0)
      fail("image_grid_thw row " + std::to_string(i / 3) + " is not a positive grid divisible by the merge size");
    Np += grid[i] * grid[i + 1] * grid[i + 2];
  }
  if ((int64_t)n_pixels != Np * vc.patch_dim())
    fail("pixel_values has " + std::to_string(n_pixels) + " values, image_grid_thw needs " + std::to_string(Np) +
         " patches x " + std::to_string(vc.patch_dim()));
  return Np;
}

template <class T>
StepPack<T> pack_step(const ModelConfig& cfg, const std::vector<StepSegment<T>>& segs, KvTable& cache, bool features) {
  const int64_t H = cfg.text.hidden;
  const size_t nds = cfg.vision.deepstack_indexes.size();
  StepPack<T> k;
  bool any_ds = false;
  size_t n_ids = 0, n_img = 0;  // one allocation each: a prompt chunk's features are megabytes
  std::vector<size_t> n_ds(nds, 0);
  for (const StepSegment<T>& g : segs) {
    n_ids += g.ids.size(), n_img += g.img.size();
    if (g.ds.empty()) continue;
    if (g.ds.size() != nds) fail("step: DeepStack features for " + std::to_string(g.ds.size()) + " layers");
    any_ds = true;
    for (size_t j = 0; j < nds; ++j) n_ds[j] += g.ds[j].size();
  }
  k.ids.reserve(n_ids), k.cu.reserve(segs.size() + 1), k.seqs.reserve(segs.size());
  if (features) {
    k.img.reserve(n_img);
    if (any_ds) k.ds.resize(nds);
    for (auto& d : k.ds) d.reserve(n_img);
  }
  for (const StepSegment<T>& g : segs) {
    const int s = g.seq;
    if (s < 0 || s >= cache.batch() || cache.len[s] < 0) fail("step: no cached sequence " + std::to_string(s));
    if (g.ids.empty()) fail("step: an empty segment for sequence " + std::to_string(s));
    k.ids.insert(k.ids.end(), g.ids.begin(), g.ids.end());
    k.cu.push_back((int64_t)k.ids.size());
    k.seqs.push_back(s);
    if (!features) continue;
    k.img.insert(k.img.end(), g.img.begin(), g.img.end());
    for (size_t j = 0; j < g.ds.size(); ++j) k.ds[j].insert(k.ds[j].end(), g.ds[j].begin(), g.ds[j].end());
  }
  const int64_t N = (int64_t)k.ids.size();
  // Positions: given with the prompt's tokens (M-RoPE of the whole prompt), else the sequence's next position.
  k.pos.resize(3 * N);
  for (size_t g = 0; g < segs.size(); ++g) {
    const int64_t n = k.cu[g + 1] - k.cu[g];
    if (!segs[g].pos3.empty() && (int64_t)segs[g].pos3.size() != 3 * n)
      fail("step: " + std::to_string(segs[g].pos3.size()) + " positions for " + std::to_string(n) + " tokens");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = segs[g].pos3.empty() ? cache.next_pos[k.seqs[g]]++ : -1;
      for (int row = 0; row < 3; ++row) k.pos[row * N + k.cu[g] + i] = p >= 0 ? p : segs[g].pos3[row * n + i];
    }
  }
  const int64_t nimg = (int64_t)std::count_if(k.ids.begin(), k.ids.end(), [&](int64_t t) { return cfg.visual_token(t); });
  if (nimg * H != (int64_t)n_img)
    fail("vision features and placeholder tokens do not match: " + std::to_string(nimg) + " tokens with id " +
         std::to_string(cfg.image_token_id) + " or " + std::to_string(cfg.video_token_id) + ", " +
         std::to_string(n_img / H) + " merged vision features");
  if (any_ds)
    for (size_t j = 0; j < nds; ++j)
      if ((int64_t)n_ds[j] != nimg * H) fail("step: DeepStack features do not match the image tokens");
  return k;
}

template StepPack<float> pack_step(const ModelConfig&, const std::vector<StepSegment<float>>&, KvTable&, bool);
template StepPack<double> pack_step(const ModelConfig&, const std::vector<StepSegment<double>>&, KvTable&, bool);

}  // namespace q3vl
