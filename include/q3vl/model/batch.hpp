// What a model runs on: padded and packed batches, the token stream a forward takes, and a continuous-batching
// step's segments (src/model/batch.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "q3vl/model/config.hpp"
#include "q3vl/model/kv_table.hpp"

namespace q3vl {

// A padded batch as HF takes it. attention_mask may be empty (= all ones). Labels are unshifted (HF shifts:
// position s predicts labels[s+1]). Padded positions (mask 0) are dropped before the model runs, so they attend
// to nothing and contribute no loss; their logits are returned as zeros.
struct Batch {
  int B = 0, S = 0;
  std::vector<int64_t> input_ids, attention_mask, labels;  // [B*S]
  std::vector<float> pixel_values;                          // [Np * 1536], all images in order
  std::vector<int64_t> image_grid_thw;                      // [Nimg * 3]
  std::vector<float> pixel_values_videos;                   // [Nv * 1536], all videos in order
  std::vector<int64_t> video_grid_thw;                      // [Nvid * 3]
};

// Several samples concatenated in one stream (training). Sample s = tokens [cu_seqlens[s], cu_seqlens[s+1]);
// samples never attend to each other, M-RoPE positions restart at 0 per sample and the label shift stays inside
// a sample (its last token predicts nothing).
struct PackedBatch {
  std::vector<int64_t> input_ids, labels, cu_seqlens;
  std::vector<float> pixel_values;
  std::vector<int64_t> image_grid_thw;
  std::vector<float> pixel_values_videos;
  std::vector<int64_t> video_grid_thw;
};

// The token stream a forward runs on: padded positions dropped, labels shifted inside each sample. orig: the row in
// logits_out of each token; out_rows: the rows of logits_out.
struct TokenStream {
  std::vector<int64_t> ids, targets, cu, orig;
  int64_t out_rows = 0;
};
TokenStream token_stream(const Batch& b);
TokenStream token_stream(const PackedBatch& b);
// Patches of the images in grid (checked: positive grids divisible by the merge size, n_pixels matching).
int64_t image_patches(const VisionConfig& vc, size_t n_pixels, const std::vector<int64_t>& grid);

// One sequence's share of a continuous-batching step (DevModel::step): tokens appended to cache sequence seq.
// pos3 [3][n]: their M-RoPE positions (a prompt chunk: a slice of mrope_positions over the whole prompt; empty:
// the sequence's next positions, as for generated tokens). img [n_img_tokens, H] and ds [deepstack][n_img_tokens*H]:
// the vision features of the chunk's image tokens, in order (empty without images).
template <class T>
struct StepSegment {
  int seq = 0;
  std::vector<int64_t> ids, pos3;
  std::vector<T> img;
  std::vector<std::vector<T>> ds;
};

// A step's segments packed (DevModel::step): ids with segment offsets cu and cache sequences seqs;
// M-RoPE positions pos [3][N] (a segment's pos3, else its sequence's next positions, which this advances); the image
// features in token order and the DeepStack features (ds empty when no segment brings any; features = false: neither
// gathered, only checked, the caller reading them from the segments). Fails naming the segment that does not fit the
// cache state or itself.
template <class T>
struct StepPack {
  std::vector<int64_t> ids, cu{0}, pos;
  std::vector<int> seqs;
  std::vector<T> img;
  std::vector<std::vector<T>> ds;
};
template <class T>
StepPack<T> pack_step(const ModelConfig& cfg, const std::vector<StepSegment<T>>& segs, KvTable& cache,
                      bool features = true);

}  // namespace q3vl
