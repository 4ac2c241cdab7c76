#include "q3vl/train/flops.hpp"

namespace q3vl {

FlopCounts count_flops(const std::vector<PackedBatch>& micro) {
  FlopCounts c;
  for (const PackedBatch& b : micro) {
    c.tokens += double(b.input_ids.size());
    for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s) {
      const double L = double(b.cu_seqlens[s + 1] - b.cu_seqlens[s]);
      c.text_keys += L * (L + 1) / 2;  // token i of a sample attends to i + 1 keys
    }
    for (size_t i = 0; i + 2 < b.image_grid_thw.size(); i += 3) {
      const double p = double(b.image_grid_thw[i] * b.image_grid_thw[i + 1] * b.image_grid_thw[i + 2]);
      c.patches += p;
      c.vision_keys += p * p;
    }
    for (size_t i = 0; i + 2 < b.video_grid_thw.size(); i += 3) {  // attention within each temporal patch
      const double t = double(b.video_grid_thw[i]), p = double(b.video_grid_thw[i + 1] * b.video_grid_thw[i + 2]);
      c.patches += t * p;
      c.vision_keys += t * p * p;
    }
  }
  return c;
}

double train_flops(const ParamTable& t, const FlopCounts& c) {
  const ModelConfig& cfg = t.config();
  const TextConfig& tc = cfg.text;
  const VisionConfig& vc = cfg.vision;
  const double H = tc.hidden, hd = tc.head_dim, V = tc.vocab;
  // Text: matrix weights one token touches, over all layers.
  double text_w = 0;
  for (int l = 0; l < tc.layers; ++l) {
    text_w += H * hd * (2.0 * tc.heads + 2.0 * tc.kv_heads);  // q, o and k, v
    text_w += t.moe_layer(l) ? tc.num_experts * H + tc.experts_per_tok * 3.0 * tc.moe_intermediate * H
                             : 3.0 * tc.intermediate * H;
  }
  // Vision: per patch, the patch embedding and every block; per merged token (merge² patches), each merger.
  const double Dv = vc.hidden, Dm = Dv * vc.merge * vc.merge, Dout = vc.out_hidden;
  const double vis_w = double(vc.patch_dim()) * Dv + vc.depth * (4.0 * Dv * Dv + 2.0 * vc.intermediate * Dv);
  const double merger_w = (1.0 + double(vc.deepstack_indexes.size())) * (Dm * Dm + Dm * Dout);
  const double fwd = 2 * text_w * c.tokens + 4 * tc.heads * hd * c.text_keys * tc.layers + 2 * V * H * c.tokens +
                     2 * vis_w * c.patches + 2 * merger_w * c.patches / (vc.merge * vc.merge) +
                     4 * Dv * c.vision_keys * vc.depth;
  return 3 * fwd;
}

}  // namespace q3vl
