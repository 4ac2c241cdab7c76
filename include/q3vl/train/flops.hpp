// Model FLOPs of a training step, exactly as DESIGN.md "Counting FLOPs (MFU)" defines them: per token (or
// image patch) and per layer 2 FLOPs per weight of every matrix it touches (MoE: its k experts and the router),
// attention 4·d·c (d = heads × head_dim, c = keys attended to), LM head 2·V·H; training = 3 × forward.
// Recomputation is not counted.
#pragma once
#include <vector>

#include "q3vl/model/config.hpp"
#include "q3vl/model/batch.hpp"
#include "q3vl/model/params.hpp"

namespace q3vl {

// The formula's inputs for a set of packed micro-batches (summable over ranks: all plain counts).
struct FlopCounts {
  double tokens = 0;        // text tokens (each runs the decoder and the LM head)
  double text_keys = 0;     // sum over tokens of keys attended to: causal, within the sample
  double patches = 0;       // vision patches (each runs the ViT blocks)
  double vision_keys = 0;   // sum over patches of its image's patch count
  static constexpr int kFields = 4;
  double* data() { return &tokens; }
};

FlopCounts count_flops(const std::vector<PackedBatch>& micro);
// 3 × the forward's model FLOPs of those counts.
double train_flops(const ParamTable& t, const FlopCounts& c);

}  // namespace q3vl
