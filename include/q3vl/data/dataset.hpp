// What training reads: random access to tokenized samples with their images already patchified.
// The HDF5 shard dataset (data/) and the synthetic datasets of tests implement it; the loader (order over
// ranks, packing, cursor) is written against it alone.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace q3vl {

struct Sample {
  std::vector<int64_t> input_ids;       // [n]
  std::vector<int64_t> labels;          // [n], -100 where not supervised; unshifted (HF convention)
  std::vector<float> pixel_values;      // [Np * 1536], the sample's images in order, normalised
  std::vector<int64_t> image_grid_thw;  // [Nimg * 3]
  std::vector<float> pixel_values_videos;  // [Nv * 1536], the sample's videos in order (data/video_processor.hpp)
  std::vector<int64_t> video_grid_thw;     // [Nvid * 3]
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual size_t size() const = 0;
  virtual Sample get(size_t index) const = 0;
  // Token count of a sample without loading its pixels (packing plans with it).
  virtual size_t length(size_t index) const { return get(index).input_ids.size(); }
  // Names a sample in messages ("shard-00003.h5 sample 17 (line 1234 of train.jsonl)").
  virtual std::string describe(size_t index) const { return "sample " + std::to_string(index); }
};

}  // namespace q3vl
