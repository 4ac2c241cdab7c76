#include "q3vl/data/shards.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "q3vl/core/error.hpp"
#include "q3vl/io/checkpoint.hpp"

namespace q3vl {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const int64_t kShardVersion = 2;  // 2: videos

// Reads elements [off, off+n) of a 1-D dataset; the bounds were checked when the shard was opened.
void read_slice(const H5File& f, const std::string& name, hid_t mem_type, uint64_t off, uint64_t n, void* out) {
  if (n == 0) return;
  const hid_t d = H5Dopen2(f.id(), name.c_str(), H5P_DEFAULT);
  if (d < 0) fail(f.path() + ": no dataset '" + name + "'");
  const hid_t file_space = H5Dget_space(d);
  const hsize_t start = off, count = n;
  const hid_t mem_space = H5Screate_simple(1, &count, nullptr);
  herr_t st = H5Sselect_hyperslab(file_space, H5S_SELECT_SET, &start, nullptr, &count, nullptr);
  if (st >= 0) st = H5Dread(d, mem_type, mem_space, file_space, H5P_DEFAULT, out);
  H5Sclose(mem_space);
  H5Sclose(file_space);
  H5Dclose(d);
  if (st < 0)
    fail(f.path() + ": cannot read " + name + "[" + std::to_string(off) + ":" + std::to_string(off + n) +
         "] (truncated or corrupt shard)");
}

// Offsets start at 0, never decrease and end at `total`.
void check_offsets(const std::vector<int64_t>& off, int64_t total, const std::string& what) {
  bool ok = !off.empty() && off.front() == 0 && off.back() == total;
  for (size_t i = 1; ok && i < off.size(); ++i) ok = off[i] >= off[i - 1];
  if (!ok) fail(what + " are inconsistent (corrupt shard)");
}

}  // namespace

// ---- writing ----

void ShardBuilder::add(const std::vector<int32_t>& input_ids, const std::vector<int32_t>& labels,
                       const std::vector<RgbImage>& images, const std::vector<ImageGrid>& grids, long line,
                       const std::vector<VideoClip>& videos, const std::vector<ImageGrid>& video_grids) {
  Q3VL_CHECK(input_ids.size() == labels.size() && images.size() == grids.size(), "sample parts disagree");
  ids_.insert(ids_.end(), input_ids.begin(), input_ids.end());
  labels_.insert(labels_.end(), labels.begin(), labels.end());
  for (size_t k = 0; k < images.size(); ++k) {
    pixels_.insert(pixels_.end(), images[k].px.begin(), images[k].px.end());
    pixel_off_.push_back(int64_t(pixels_.size()));
    hw_.insert(hw_.end(), {images[k].h, images[k].w});
    grid_.insert(grid_.end(), {grids[k].t, grids[k].h, grids[k].w});
  }
  Q3VL_CHECK(videos.size() == video_grids.size(), "videos and their grids disagree");
  for (size_t i = 0; i < videos.size(); ++i) {
    const VideoClip& v = videos[i];
    Q3VL_CHECK(!v.frames.empty() && v.frames.size() == v.indices.size(), "a video without frames");
    for (size_t k = 0; k < v.frames.size(); ++k) {
      Q3VL_CHECK(v.frames[k].w == v.frames[0].w && v.frames[k].h == v.frames[0].h, "a video's frames differ");
      vpixels_.insert(vpixels_.end(), v.frames[k].px.begin(), v.frames[k].px.end());
      frame_idx_.push_back(v.indices[k]);
    }
    frame_off_.push_back(int64_t(frame_idx_.size()));
    vhw_.insert(vhw_.end(), {v.frames[0].h, v.frames[0].w});
    vgrid_.insert(vgrid_.end(), {video_grids[i].t, video_grids[i].h, video_grids[i].w});
    vfps_.push_back(v.fps);
  }
  token_off_.push_back(int64_t(ids_.size()));
  image_off_.push_back(int64_t(pixel_off_.size() - 1));
  video_off_.push_back(int64_t(vfps_.size()));
  lines_.push_back(line);
}

void ShardBuilder::write(const std::string& path, const std::string& source) {
  const int64_t n = int64_t(lines_.size()), t = int64_t(ids_.size()), m = int64_t(hw_.size() / 2);
  {
    H5File f = H5File::create(path);
    f.write("input_ids", {t}, ids_);
    f.write("labels", {t}, labels_);
    f.write("sample_token_offsets", {n + 1}, token_off_);
    f.write("sample_image_offsets", {n + 1}, image_off_);
    f.write("sample_line", {n}, lines_);
    f.write("image_pixels", {int64_t(pixels_.size())}, pixels_);
    f.write("image_pixel_offsets", {m + 1}, pixel_off_);
    f.write("image_hw", {m, 2}, hw_);
    f.write("image_grid", {m, 3}, grid_);
    const int64_t v = int64_t(vfps_.size());
    f.write("sample_video_offsets", {n + 1}, video_off_);
    f.write("video_frame_offsets", {v + 1}, frame_off_);
    f.write("video_hw", {v, 2}, vhw_);
    f.write("video_grid", {v, 3}, vgrid_);
    f.write("video_fps", {v}, vfps_);
    f.write("frame_index", {int64_t(frame_idx_.size())}, frame_idx_);
    f.write("video_pixels", {int64_t(vpixels_.size())}, vpixels_);
    f.set_attr("/", "videos", v);
    f.set_attr("/", "format", "q3vl-shard");
    f.set_attr("/", "version", kShardVersion);
    f.set_attr("/", "source", source);
    f.set_attr("/", "samples", n);
    f.set_attr("/", "tokens", t);
    f.set_attr("/", "images", m);
  }
  *this = ShardBuilder();
}

std::string shard_checksum(const std::string& path) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(file_checksum(path)));
  return buf;
}

// ---- reading ----

struct ShardDataset::Shard {
  H5File file;
  std::string name;
  std::vector<int64_t> token_off, image_off, lines, pixel_off;
  std::vector<int32_t> hw, grid;
  std::vector<int64_t> video_off, frame_off, frame_idx, vpixel_off;  // vpixel_off: each video's first byte
  std::vector<int32_t> vhw, vgrid;
  std::vector<double> vfps;
  std::string checksum;   // from index.json ("" in datasets made before checksums were kept)
  bool verified = false;  // under mu_
};

// The first read from a shard checks its bytes against index.json: once per shard per run (per reading rank),
// which costs one sequential read of the file, while damage inside the data (same size, consistent offsets)
// would otherwise train silently.
void ShardDataset::verify(Shard& sh) const {
  if (sh.verified || sh.checksum.empty()) return;
  const std::string got = shard_checksum((fs::path(dir_) / sh.name).string());
  if (sh.checksum != got)
    fail("dataset " + dir_ + ": shard " + sh.name + " does not match its checksum in index.json (" + sh.checksum +
         ", the file gives " + got + "): it changed or was damaged after q3vl prepare; prepare the dataset again");
  sh.verified = true;
}

ShardDataset::~ShardDataset() = default;

ShardDataset::ShardDataset(const std::string& path) {
  const fs::path index = fs::is_directory(path) ? fs::path(path) / "index.json" : fs::path(path);
  dir_ = index.parent_path().string();
  std::ifstream in(index);
  if (!in) fail("dataset '" + path + "': cannot open " + index.string() + " (run q3vl prepare first)");
  json man;
  struct Entry {
    std::string file;
    int64_t samples, tokens, images;
    std::string checksum;
  };
  std::vector<Entry> entries;
  int64_t samples = 0;  // total in the manifest
  try {
    man = json::parse(in);
  } catch (const json::exception& e) {
    fail(index.string() + ": bad JSON: " + e.what());
  }
  try {
    if (man.at("format") != "q3vl-dataset") fail(index.string() + ": not a q3vl dataset manifest");
    source_ = man.at("source").get<std::string>();
    const json& im = man.at("image");
    image_.patch = im.at("patch");
    image_.temporal_patch = im.at("temporal_patch");
    image_.merge = im.at("merge");
    image_.min_pixels = im.at("min_pixels");
    image_.max_pixels = im.at("max_pixels");
    image_.min_side = im.at("min_side");
    for (int c = 0; c < 3; ++c) image_.mean[c] = im.at("mean").at(c), image_.std[c] = im.at("std").at(c);
    if (man.contains("video")) {
      const json& vj = man.at("video");
      video_.patch = vj.at("patch"), video_.temporal_patch = vj.at("temporal_patch"), video_.merge = vj.at("merge");
      video_.fps = vj.at("fps"), video_.min_frames = vj.at("min_frames"), video_.max_frames = vj.at("max_frames");
      video_.min_pixels = vj.at("min_pixels"), video_.max_pixels = vj.at("max_pixels");
      for (int c = 0; c < 3; ++c) video_.mean[c] = vj.at("mean").at(c), video_.std[c] = vj.at("std").at(c);
    }
    for (const json& e : man.at("shards"))
      entries.push_back({e.at("file").get<std::string>(), e.at("samples"), e.at("tokens"), e.at("images"),
                         e.value("checksum", std::string())});
    samples = man.at("samples").get<int64_t>();
  } catch (const json::exception& e) {
    fail(index.string() + ": malformed manifest: " + e.what());
  }

  for (const Entry& entry : entries) {
    const std::string& name = entry.file;
    const std::string what = "dataset " + dir_ + ": shard " + name;
    std::unique_ptr<Shard> sh;
    try {
      sh = std::make_unique<Shard>(
          Shard{H5File::open((fs::path(dir_) / name).string()), name, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {},
                entry.checksum, false});
    } catch (const Error& e) {
      fail(what + " cannot be opened (missing, truncated or corrupt): " + e.what());
    }
    const H5File& f = sh->file;
    if (!f.has_attr("/", "format") || f.attr_string("/", "format") != "q3vl-shard")
      fail(what + " is not a q3vl shard");
    const int64_t n = f.attr_int("/", "samples"), t = f.attr_int("/", "tokens"), m = f.attr_int("/", "images");
    if (n != entry.samples || t != entry.tokens || m != entry.images)
      fail(what + ": its counts differ from index.json (a shard from another run?)");
    auto want_shape = [&](const std::string& ds, std::vector<int64_t> shape) {
      if (!f.is_dataset(ds) || f.shape(ds) != shape) fail(what + ": dataset '" + ds + "' is missing or misshapen");
    };
    want_shape("input_ids", {t});
    want_shape("labels", {t});
    want_shape("image_hw", {m, 2});
    want_shape("image_grid", {m, 3});
    sh->token_off = f.read<int64_t>("sample_token_offsets");
    sh->image_off = f.read<int64_t>("sample_image_offsets");
    sh->lines = f.read<int64_t>("sample_line");
    sh->pixel_off = f.read<int64_t>("image_pixel_offsets");
    sh->hw = f.read<int32_t>("image_hw");
    sh->grid = f.read<int32_t>("image_grid");
    if (int64_t(sh->lines.size()) != n) fail(what + ": sample_line has the wrong length");
    check_offsets(sh->token_off, t, what + ": sample_token_offsets");
    check_offsets(sh->image_off, m, what + ": sample_image_offsets");
    if (sh->token_off.size() != size_t(n + 1) || sh->image_off.size() != size_t(n + 1))
      fail(what + ": sample offsets have the wrong length");
    std::vector<int64_t> pixels_shape{sh->pixel_off.empty() ? -1 : sh->pixel_off.back()};
    want_shape("image_pixels", pixels_shape);
    check_offsets(sh->pixel_off, pixels_shape[0], what + ": image_pixel_offsets");
    if (sh->pixel_off.size() != size_t(m + 1)) fail(what + ": image_pixel_offsets has the wrong length");
    const int side = image_.patch * image_.merge;
    for (int64_t k = 0; k < m; ++k) {
      const int h = sh->hw[2 * k], w = sh->hw[2 * k + 1];
      if (h <= 0 || w <= 0 || h % side || w % side || sh->pixel_off[k + 1] - sh->pixel_off[k] != int64_t(h) * w * 3 ||
          sh->grid[3 * k] != 1 || sh->grid[3 * k + 1] != h / image_.patch || sh->grid[3 * k + 2] != w / image_.patch)
        fail(what + ": image " + std::to_string(k) + " has an inconsistent size or grid (corrupt shard)");
    }
    read_videos(*sh, n, what);
    for (size_t i = 0; i < sh->lines.size(); ++i) order_.push_back({sh->lines[i], uint32_t(shards_.size()), uint32_t(i)});
    shards_.push_back(std::move(sh));
  }
  std::sort(order_.begin(), order_.end(), [](const Ref& a, const Ref& b) { return a.line < b.line; });
  for (size_t i = 1; i < order_.size(); ++i)
    if (order_[i].line == order_[i - 1].line)
      fail("dataset " + dir_ + ": line " + std::to_string(order_[i].line) + " appears in two samples (" +
           shards_[order_[i - 1].shard]->name + ", " + shards_[order_[i].shard]->name + ")");
  if (samples != int64_t(order_.size()))
    fail("dataset " + dir_ + ": index.json counts " + std::to_string(samples) + " samples, the shards hold " +
         std::to_string(order_.size()));
}

// The video datasets of a version-2 shard, checked like the images' (a version-1 shard has no videos).
void ShardDataset::read_videos(Shard& sh, int64_t n, const std::string& what) const {
  const H5File& f = sh.file;
  if (!f.exists("sample_video_offsets")) {
    sh.video_off.assign(size_t(n + 1), 0), sh.frame_off = {0}, sh.vpixel_off = {0};
    return;
  }
  const int64_t v = f.has_attr("/", "videos") ? f.attr_int("/", "videos") : -1;
  sh.video_off = f.read<int64_t>("sample_video_offsets");
  sh.frame_off = f.read<int64_t>("video_frame_offsets");
  sh.frame_idx = f.read<int64_t>("frame_index");
  sh.vhw = f.read<int32_t>("video_hw");
  sh.vgrid = f.read<int32_t>("video_grid");
  sh.vfps = f.read<double>("video_fps");
  if (v < 0 || sh.video_off.size() != size_t(n + 1) || sh.frame_off.size() != size_t(v + 1) ||
      sh.vhw.size() != size_t(2 * v) || sh.vgrid.size() != size_t(3 * v) || sh.vfps.size() != size_t(v))
    fail(what + ": the video datasets disagree in length (corrupt shard)");
  check_offsets(sh.video_off, v, what + ": sample_video_offsets");
  check_offsets(sh.frame_off, int64_t(sh.frame_idx.size()), what + ": video_frame_offsets");
  const int side = video_.patch * video_.merge;
  sh.vpixel_off = {0};
  for (int64_t k = 0; k < v; ++k) {
    const int h = sh.vhw[2 * k], w = sh.vhw[2 * k + 1];
    const int64_t frames = sh.frame_off[k + 1] - sh.frame_off[k];
    if (h <= 0 || w <= 0 || h % side || w % side || frames <= 0 || !(sh.vfps[k] > 0) ||
        sh.vgrid[3 * k] != (frames + video_.temporal_patch - 1) / video_.temporal_patch ||
        sh.vgrid[3 * k + 1] != h / video_.patch || sh.vgrid[3 * k + 2] != w / video_.patch)
      fail(what + ": video " + std::to_string(k) + " has an inconsistent size, frame count or grid (corrupt shard)");
    sh.vpixel_off.push_back(sh.vpixel_off.back() + frames * h * w * 3);
  }
  if (!f.is_dataset("video_pixels") || f.shape("video_pixels") != std::vector<int64_t>{sh.vpixel_off.back()})
    fail(what + ": dataset 'video_pixels' is missing or misshapen");
}

std::vector<VideoClip> ShardDataset::videos(size_t index) const {
  const Ref& r = at(index);
  const Shard& sh = *shards_[r.shard];
  std::vector<VideoClip> out;
  std::lock_guard<std::mutex> lock(mu_);
  verify(*shards_[r.shard]);
  for (int64_t k = sh.video_off[r.local]; k < sh.video_off[r.local + 1]; ++k) {
    VideoClip c;
    c.fps = sh.vfps[size_t(k)];
    const int h = sh.vhw[2 * k], w = sh.vhw[2 * k + 1];
    const size_t bytes = size_t(h) * w * 3;
    for (int64_t fr = sh.frame_off[k]; fr < sh.frame_off[k + 1]; ++fr) {
      RgbImage im;
      im.h = h, im.w = w;
      im.px.resize(bytes);
      read_slice(sh.file, "video_pixels", H5T_NATIVE_UINT8,
                 uint64_t(sh.vpixel_off[k]) + uint64_t(fr - sh.frame_off[k]) * bytes, bytes, im.px.data());
      c.frames.push_back(std::move(im));
      c.indices.push_back(sh.frame_idx[size_t(fr)]);
    }
    out.push_back(std::move(c));
  }
  return out;
}

const ShardDataset::Ref& ShardDataset::at(size_t index) const {
  if (index >= order_.size())
    fail("dataset " + dir_ + ": sample " + std::to_string(index) + " is out of range (size " +
         std::to_string(order_.size()) + ")");
  return order_[index];
}

long ShardDataset::line(size_t index) const { return at(index).line; }

size_t ShardDataset::length(size_t index) const {
  const Ref& r = at(index);
  const Shard& sh = *shards_[r.shard];
  return size_t(sh.token_off[r.local + 1] - sh.token_off[r.local]);
}

std::string ShardDataset::describe(size_t index) const {
  const Ref& r = at(index);
  return shards_[r.shard]->name + " sample " + std::to_string(r.local) + " (line " + std::to_string(r.line) + " of " +
         source_ + ")";
}

std::vector<RgbImage> ShardDataset::images(size_t index) const {
  const Ref& r = at(index);
  const Shard& sh = *shards_[r.shard];
  std::vector<RgbImage> out;
  std::lock_guard<std::mutex> lock(mu_);
  verify(*shards_[r.shard]);
  for (int64_t k = sh.image_off[r.local]; k < sh.image_off[r.local + 1]; ++k) {
    RgbImage im;
    im.h = sh.hw[2 * k];
    im.w = sh.hw[2 * k + 1];
    im.px.resize(size_t(sh.pixel_off[k + 1] - sh.pixel_off[k]));
    read_slice(sh.file, "image_pixels", H5T_NATIVE_UINT8, uint64_t(sh.pixel_off[k]), im.px.size(), im.px.data());
    out.push_back(std::move(im));
  }
  return out;
}

Sample ShardDataset::get(size_t index) const {
  const Ref& r = at(index);
  const Shard& sh = *shards_[r.shard];
  const int64_t a = sh.token_off[r.local], n = sh.token_off[r.local + 1] - a;
  std::vector<int32_t> ids(static_cast<size_t>(n)), labels(static_cast<size_t>(n));
  {
    std::lock_guard<std::mutex> lock(mu_);
    verify(*shards_[r.shard]);
    read_slice(sh.file, "input_ids", H5T_NATIVE_INT32, uint64_t(a), uint64_t(n), ids.data());
    read_slice(sh.file, "labels", H5T_NATIVE_INT32, uint64_t(a), uint64_t(n), labels.data());
  }
  Sample s;
  s.input_ids.assign(ids.begin(), ids.end());
  s.labels.assign(labels.begin(), labels.end());
  for (const RgbImage& im : images(index)) {
    const ImageGrid g = patchify(im, image_, s.pixel_values);
    s.image_grid_thw.insert(s.image_grid_thw.end(), {g.t, g.h, g.w});
  }
  for (const VideoClip& v : videos(index)) {
    const ImageGrid g = patchify_clip(v, video_, s.pixel_values_videos);
    s.video_grid_thw.insert(s.video_grid_thw.end(), {g.t, g.h, g.w});
  }
  return s;
}

}  // namespace q3vl
