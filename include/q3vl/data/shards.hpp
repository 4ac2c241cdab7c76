// The prepared dataset: HDF5 shards written by `q3vl prepare` and read back as a Dataset.
//
// A dataset is a folder with index.json (the manifest: shards, counts, image settings, what was dropped) and
// shard files. One shard (all 1-D unless noted; tokens, samples and images concatenated):
//   input_ids int32 [T], labels int32 [T] (-100 where not supervised)
//   sample_token_offsets int64 [n+1], sample_image_offsets int64 [n+1], sample_line int64 [n] (1-based line of
//   the source JSONL)
//   image_pixels uint8 [sum h*w*3] (resized RGB, row-major), image_pixel_offsets int64 [m+1],
//   image_hw int32 [m, 2] (resized height, width), image_grid int32 [m, 3] (t, h, w in patches)
//   videos (version 2; absent: none): sample_video_offsets int64 [n+1], video_frame_offsets int64 [v+1] (into the
//   frames), video_hw int32 [v, 2], video_grid int32 [v, 3] (temporal patches, h, w in patches), video_fps f64 [v]
//   (the source's rate), frame_index int64 [F] (each stored frame's index in the source: timestamps), video_pixels
//   uint8 [sum frames*h*w*3] (the sampled, resized frames, not padded to pairs)
//   attributes on "/": format "q3vl-shard", version, source (the JSONL path), samples, tokens, images, videos
// index.json lists each shard with its counts and "checksum" (shard_checksum), which the first read from the shard
// in a run verifies.
// The global order of samples is the order of their source lines, whatever the shards and ranks that made them.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "q3vl/data/dataset.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/video_processor.hpp"
#include "q3vl/io/h5.hpp"

namespace q3vl {

// Collects prepared samples in memory and writes them as one shard file.
class ShardBuilder {
 public:
  // images: resized (sides multiples of patch*merge), one grid each.
  void add(const std::vector<int32_t>& input_ids, const std::vector<int32_t>& labels,
           const std::vector<RgbImage>& images, const std::vector<ImageGrid>& grids, long line,
           const std::vector<VideoClip>& videos = {}, const std::vector<ImageGrid>& video_grids = {});
  size_t samples() const { return lines_.size(); }
  size_t tokens() const { return ids_.size(); }
  // Writes the shard (replacing `path`) and empties the builder.
  void write(const std::string& path, const std::string& source);

 private:
  std::vector<int32_t> ids_, labels_, hw_, grid_, vhw_, vgrid_;
  std::vector<int64_t> token_off_{0}, image_off_{0}, lines_, pixel_off_{0}, video_off_{0}, frame_off_{0}, frame_idx_;
  std::vector<double> vfps_;
  std::vector<uint8_t> pixels_, vpixels_;
};

// What index.json stores for a shard file: 16 hex digits of io/checkpoint.hpp's file_checksum.
std::string shard_checksum(const std::string& path);

class ShardDataset : public Dataset {
 public:
  // `path`: the dataset folder or its index.json. Checks every shard's layout against the manifest; a missing,
  // truncated or inconsistent shard is an error naming it.
  explicit ShardDataset(const std::string& path);
  ~ShardDataset() override;

  size_t size() const override { return order_.size(); }
  Sample get(size_t index) const override;
  size_t length(size_t index) const override;
  std::string describe(size_t index) const override;

  long line(size_t index) const;                      // source line of sample `index`
  const std::string& source() const { return source_; }
  const ImageConfig& image_config() const { return image_; }
  const VideoConfig& video_config() const { return video_; }
  std::vector<RgbImage> images(size_t index) const;  // the stored resized uint8 images
  std::vector<VideoClip> videos(size_t index) const;  // the stored sampled, resized uint8 frames

 private:
  struct Shard;
  struct Ref {
    long line;
    uint32_t shard, local;
  };
  const Ref& at(size_t index) const;
  void verify(Shard& sh) const;  // checksum on first read; caller holds mu_
  void read_videos(Shard& sh, int64_t samples, const std::string& what) const;

  std::string dir_, source_;
  ImageConfig image_;
  VideoConfig video_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<Ref> order_;
  mutable std::mutex mu_;  // HDF5 is not thread-safe
};

}  // namespace q3vl
