// `q3vl synth`: the demo's synthetic data set. Each picture shows one shape (circle, square, triangle, star, cross)
// in one colour (of varying shade) at a random place and size on a noisy, tinted, graded grey background; the
// conversation asks what the picture shows and the answer is exactly "a <colour> <shape>" ("an orange ..."), or with
// synth.answer_format = "fields" "shape: <shape>, colour: <colour>" (what `make demo-lora` teaches adapters).
// Written as PNGs plus train.jsonl, val.jsonl (validation: what the demo was tuned on) and eval.jsonl (held out)
// in the messages format (image paths relative to the JSONL). Deterministic for its seeds; every split draws
// from its own stream, and the held-out one from its own seed.
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

// How the answer names what the picture shows; the picture does not depend on it.
enum class SynthFormat { Sentence, ShapeFirst, Fields };
SynthFormat synth_format(const std::string& name);  // synth.answer_format: "sentence", "shape-first", "fields"

// Sentence: "a red circle", "an orange square". ShapeFirst: "a circle red". Fields: "shape: circle, colour: red".
std::string synth_answer(int colour, int shape, SynthFormat format = SynthFormat::Sentence);

// Sample `index` of split 0 (train), 1 (val) or 2 (eval), size x size pixels.
SynthSample synth_sample(uint64_t seed, int split, int64_t index, int size,
                         SynthFormat format = SynthFormat::Sentence);

struct SynthCounts {
  int64_t train = 0, val = 0, eval = 0;
};

// Writes dir/images/{train,val,eval}_NNNNNN.png and dir/{train,val,eval}.jsonl (val.jsonl only if counts.val > 0):
// train and val from `seed`, eval from `eval_seed`.
void write_synth(const std::string& dir, const SynthCounts& counts, int size, uint64_t seed, uint64_t eval_seed,
                 SynthFormat format = SynthFormat::Sentence);

int run_synth(const Deck& deck);

}  // namespace q3vl
