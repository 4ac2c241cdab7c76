// `q3vl synth`: the demo's synthetic data set. Each picture shows one shape (circle, square, triangle, star, cross)
// in one colour at a random place and size on a noisy dark-grey background; the conversation asks what the picture
// shows and the answer is exactly "a <colour> <shape>". Written as PNGs plus train.jsonl and eval.jsonl in the
// messages format (image paths relative to the JSONL). Deterministic for a seed; the two splits draw from
// different streams.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/data/image.hpp"

namespace q3vl {

struct SynthColour {
  const char* name;
  uint8_t rgb[3];
};
const std::vector<SynthColour>& synth_colours();
const std::vector<std::string>& synth_shapes();

struct SynthSample {
  RgbImage image;
  int shape = 0, colour = 0;  // indexes into synth_shapes() / synth_colours()
  std::string question, answer;
};

// Sample `index` of split 0 (train) or 1 (eval), size x size pixels.
SynthSample synth_sample(uint64_t seed, int split, int64_t index, int size);

// Writes dir/images/{train,eval}_NNNNNN.png, dir/train.jsonl and dir/eval.jsonl.
void write_synth(const std::string& dir, int64_t train, int64_t eval, int size, uint64_t seed);

int run_synth(const Deck& deck);

}  // namespace q3vl
