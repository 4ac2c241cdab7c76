// `q3vl eval`: one forward (and optionally backward) pass of a HF model over a batch file, written out
// for comparison with Hugging Face transformers (tools/make_goldens.py makes the reference files).
#pragma once
#include <string>

#include "q3vl/core/deck.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/model/batch.hpp"

namespace q3vl {

// BATCH.h5: input_ids, attention_mask, labels (int64 [B,S]), pixel_values (f32 [Np,1536]), image_grid_thw
// (int64 [Nimg,3]), pixel_values_videos (f32 [Nv,1536]) and video_grid_thw (int64 [Nvid,3]); each pixel/grid pair may
// be absent.
Batch read_batch_h5(const std::string& path, int64_t patch_dim);

struct EvalResult {
  std::vector<float> logits;  // [B,S,V]
  double loss = 0, aux = 0;
  std::vector<NamedTensor> grads;  // by HF name, in the on-disk layout (empty unless asked)
};
// The pass on the device model; `host` holds the table and receives the gradients for grads_hf.
EvalResult evaluate(DevModel& model, HostWeights& host, const Batch& batch, bool grads, bool aux_loss);
// What a DevModel must be sized for to run `batch`.
DevBudget budget_for(const Batch& batch, int64_t patch_dim);

int run_eval(const Deck& deck);

}  // namespace q3vl
