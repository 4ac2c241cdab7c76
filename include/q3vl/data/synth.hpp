// `q3vl synth`: the demo's synthetic data set. Each picture shows one shape (circle, square, triangle, star, cross)
// in one colour (of varying shade) at a random place and size on a noisy, tinted, graded grey background; the
// conversation asks what the picture shows and the answer is exactly "a <colour> <shape>" ("an orange ..."), or with
// synth.answer_format = "fields" "shape: <shape>, colour: <colour>" (what `make demo-lora` teaches adapters).
// Written as PNGs plus train.jsonl, val.jsonl (validation: what the demo was tuned on) and eval.jsonl (held out)
// in the messages format (image paths relative to the JSONL). Deterministic for its seeds; every split draws
// from its own stream, and the held-out one from its own seed.
//
// With synth.kind = "video" (what `make demo-video` trains on) it writes short clips instead (clips/*.mp4, encoded
// with libavcodec: H.264 when this libavcodec has libx264, else MPEG-4 part 2): a circle or a square of one colour
// crosses about half the frame to the left, right, up or down on the same kind of background (fresh noise every
// frame); the answer is "a red circle moving left" (fields: "shape: circle, colour: red, moving: left"), the part
// {"type": "video", "video": "clips/train_000000.mp4"}.
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

// ---- clips (synth.kind = "video") ----

const std::vector<std::string>& synth_directions();  // left, right, up, down: where a clip's shape moves

struct SynthClip {
  std::vector<RgbImage> frames;
  int shape = 0, colour = 0, direction = 0;  // indexes into synth_shapes() (0 or 1), synth_colours(), synth_directions()
  std::string question, answer;
};

// synth_answer's words and the direction: "a red circle moving left", "shape: circle, colour: red, moving: left".
std::string synth_clip_answer(int colour, int shape, int direction, SynthFormat format = SynthFormat::Sentence);

// How big a clip's shape is and how far it moves, start to end, as fractions of the frame's side (each drawn
// uniformly between its min and max); the shape stays whole inside the frame. step > 0: the shape moves step pixels
// a frame instead (travel_min/max unused). grid > 0: its centre starts (and, across the way it moves, stays) at
// grid * k + grid / 2 pixels: on a grid of the processor's 16-px patches when the frames are upscaled by 16 / grid.
struct SynthMotion {
  double radius_min = 0.24, radius_max = 0.28;
  double travel_min = 0.30, travel_max = 0.38;
  int step = 0;  // pixels a frame; 0: travel_min..max over the clip
  int grid = 0;  // pixels; 0: the start and the place across vary continuously
  // An easier lesson: the shape starts in the middle, so that where it ends alone tells the way (one frame
  // suffices); travel is cut to what fits. For training clips only (SynthVideo::centre_starts).
  bool from_centre = false;
};

// Clip `index` of split 0/1/2: `frames` frames of size x size pixels (size even, at least 32; frames at least 2).
SynthClip synth_clip(uint64_t seed, int split, int64_t index, int size, int frames,
                     SynthFormat format = SynthFormat::Sentence, const SynthMotion& motion = {});

struct SynthVideo {
  int size = 64;        // frame side in pixels
  int frames = 8;       // frames per clip
  double fps = 8;       // the clips' frame rate
  std::string encoder;  // a libavcodec encoder; empty: default_video_encoder() (libx264, else mpeg4)
  SynthMotion motion;   // the shape's size and travel
  // The fraction of the training clips (split 0) that start in the middle (motion.from_centre): an easier lesson
  // in where the shape goes. Validation and held-out clips never do.
  double centre_starts = 0;
};

// Writes dir/clips/{train,val,eval}_NNNNNN.mp4 and the JSONL files as write_synth does; returns the encoder used.
std::string write_synth_video(const std::string& dir, const SynthCounts& counts, const SynthVideo& video,
                              uint64_t seed, uint64_t eval_seed, SynthFormat format = SynthFormat::Sentence);

int run_synth(const Deck& deck);

}  // namespace q3vl
