#include "q3vl/data/prepare.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/core/paths.hpp"
#include "q3vl/data/chat.hpp"
#include "q3vl/data/shards.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/io/h5.hpp"
#include "q3vl/runtime/comm.hpp"
#include "q3vl/runtime/runtime.hpp"

namespace q3vl {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

enum Reason { kBadRecord, kMissing, kUnreadable, kTooSmall, kAspect, kTooLong, kReasons };
const char* const kReasonNames[kReasons] = {"bad record",      "missing image",             "unreadable image",
                                            "image too small", "aspect ratio beyond 200:1", "too many tokens"};
const int kWarnLimit = 10;  // dropped samples reported per rank in skip mode

// A sample that cannot be used, with why.
struct BadSample {
  Reason reason;
  std::string msg;
};

struct Prepared {
  EncodedChat enc;
  std::vector<RgbImage> images;
  std::vector<ImageGrid> grids;
  std::vector<VideoClip> videos;
  std::vector<ImageGrid> video_grids;
};

Prepared prepare_record(const std::string& text, long line, const PrepareOptions& opt, const fs::path& root,
                        const Tokenizer& tok) {
  Prepared out;
  Conversation conv;
  try {
    conv = parse_line(text, opt.input, line);
  } catch (const Error& e) {
    throw BadSample{kBadRecord, e.what()};
  }
  const ImageConfig& ic = opt.image;
  for (size_t k = 0; k < conv.images.size(); ++k) {
    const std::string& rel = conv.images[k];
    const fs::path path = fs::path(rel).is_absolute() ? fs::path(rel) : root / rel;
    const std::string name = conv.where() + ": image " + std::to_string(k + 1) + " '" + rel + "'";
    if (!fs::is_regular_file(path)) throw BadSample{kMissing, name + ": no such file " + path.string()};
    RgbImage im;
    try {
      im = load_image(path.string());
    } catch (const Error& e) {
      throw BadSample{kUnreadable, name + ": " + e.what()};
    }
    const std::string size = std::to_string(im.w) + "x" + std::to_string(im.h);
    if (std::min(im.w, im.h) < ic.min_side)
      throw BadSample{kTooSmall, name + ": " + size + " is smaller than prepare.min_side = " +
                                     std::to_string(ic.min_side) + " pixels"};
    if (std::max(im.w, im.h) > 200.0 * std::min(im.w, im.h))
      throw BadSample{kAspect, name + ": " + size + " has an aspect ratio beyond 200:1 (smart_resize refuses it)"};
    out.images.push_back(resize_for_model(im, ic, name));
    out.grids.push_back({1, out.images.back().h / ic.patch, out.images.back().w / ic.patch});
  }
  std::vector<VideoGrid> vgrids;
  for (size_t k = 0; k < conv.videos.size(); ++k) {
    const VideoRef& v = conv.videos[k];
    try {
      out.videos.push_back(load_video_part(v, opt.video, root.string(), video_part_name(v)));
    } catch (const Error& e) {
      const std::string msg = e.what();
      throw BadSample{msg.find(": no such file ") != std::string::npos ? kMissing : kUnreadable, msg};
    }
    const VideoClip& clip = out.videos.back();
    const ImageGrid g{clip.temporal_patches(opt.video.temporal_patch), clip.frames[0].h / opt.video.patch,
                      clip.frames[0].w / opt.video.patch};
    out.video_grids.push_back(g);
    vgrids.push_back({g, clip_timestamps(clip.indices, clip.fps, opt.video.temporal_patch)});
  }
  try {
    out.enc = encode_conversation(conv, tok, out.grids, ic.merge, vgrids);
  } catch (const Error& e) {
    throw BadSample{kBadRecord, e.what()};
  }
  if (opt.max_tokens > 0 && long(out.enc.input_ids.size()) > opt.max_tokens)
    throw BadSample{kTooLong, conv.where() + ": " + std::to_string(out.enc.input_ids.size()) +
                                  " tokens, more than prepare.max_tokens = " + std::to_string(opt.max_tokens)};
  return out;
}

std::string shard_name(int rank, long k) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "shard-r%04d-%05ld.h5", rank, k);
  return buf;
}

bool blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

fs::path partial_dir(const fs::path& out) {
  fs::path p = out;
  if (!p.has_filename()) p = p.parent_path();  // "data/shards/"
  return p.string() + ".partial";
}

// What a dataset folder holds: index.json, shard-*.h5 and dot files (markers such as the job scripts' .done).
// Anything else means the folder is not (only) a dataset, and replacing it as a whole would delete it.
bool dataset_file(const std::string& name) {
  return name == "index.json" || name == "index.json.tmp" || (name.rfind("shard-", 0) == 0 && name.size() > 9 &&
                                                              name.compare(name.size() - 3, 3, ".h5") == 0);
}

// prepare.output before any work: new, empty, or a dataset that prepare.overwrite allows to replace.
void check_output(const fs::path& out, bool overwrite) {
  const std::string key = "prepare.output '" + out.string() + "'";
  std::error_code ec;
  if (!fs::exists(out, ec)) return;
  if (!fs::is_directory(out, ec)) fail(key + " is a file; it must be a dataset folder");
  std::string foreign, any;
  bool dataset = false;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string n = e.path().filename().string();
    if (any.empty()) any = n;
    if (n == "index.json") dataset = true;
    if (!dataset_file(n) && n[0] != '.' && foreign.empty()) foreign = n;
  }
  if (any.empty()) return;
  if (!foreign.empty())
    fail(key + " holds files that are not part of a dataset (such as '" + foreign +
         "'); a dataset replaces its folder as a whole: choose a new or empty folder");
  if (!overwrite)
    fail(key + (dataset ? " already holds a dataset (index.json)" : " is not empty ('" + any + "')") +
         "; set prepare.overwrite = true to replace it, or choose another folder");
}

// The finished dataset replaces the output folder in one step (Linux: an atomic exchange); the old one is
// removed only then.
void publish(const fs::path& part, const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) {
    fs::rename(part, out);
    return;
  }
  if (renameat2(AT_FDCWD, part.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS)
      fail("cannot move " + part.string() + " into place at " + out.string() + ": " + std::strerror(errno));
    const fs::path old = part.string() + ".old";  // a filesystem without the exchange: two renames
    fs::remove_all(old);
    fs::rename(out, old);
    fs::rename(part, out);
    fs::remove_all(old);
    return;
  }
  fs::remove_all(part);  // now the old dataset
}

// Rank 0 runs `f`; its error (if any) becomes a collective one.
template <class F>
void on_root(Comm& comm, F&& f) {
  std::string err;
  if (comm.rank() == 0) {
    try {
      f();
    } catch (const std::exception& e) {
      err = e.what();
      if (err.empty()) err = "unknown error";
    }
  }
  comm.broadcast_string(err, 0);
  if (!err.empty()) fail_all(err);
}

}  // namespace

std::string PrepareSummary::text() const {
  std::string s = "prepare: " + std::to_string(records) + " record(s) -> " + std::to_string(samples) + " sample(s) (" +
                  std::to_string(tokens) + " tokens, " + std::to_string(supervised) + " supervised, " +
                  std::to_string(images) + " images" + (videos ? ", " + std::to_string(videos) + " videos" : "") +
                  ") in " + std::to_string(shards) + " shard(s)";
  if (unsupervised > 0) s += "; " + std::to_string(unsupervised) + " sample(s) without supervised tokens";
  int64_t dropped_total = 0;
  std::string why;
  for (const auto& [reason, n] : dropped) {
    dropped_total += n;
    why += (why.empty() ? "" : ", ") + reason + " " + std::to_string(n);
  }
  return s + "; dropped " + std::to_string(dropped_total) + (why.empty() ? "" : " (" + why + ")");
}

PrepareSummary prepare_dataset(const PrepareOptions& opt, const Tokenizer& tok, Comm& comm) {
  const int rank = comm.rank(), size = comm.size();
  if (opt.shard_size < 1) fail_all("prepare.shard_size must be at least 1");
  const fs::path out_dir(opt.output);
  const fs::path root = opt.image_root.empty() ? fs::path(opt.input).parent_path() : fs::path(opt.image_root);

  // Every rank reads the same files: their errors are collective. (An ifstream also opens a folder.)
  if (const std::string e = need_file("prepare.input", opt.input); !e.empty()) fail_all(e);
  std::ifstream in(opt.input);
  if (!in) fail_all("prepare.input: cannot open '" + opt.input + "'");
  // Written like a checkpoint: into <output>.partial, which replaces <output> only once complete, so that a
  // failed or killed prepare leaves an existing dataset as it was.
  const fs::path part = partial_dir(out_dir);
  on_root(comm, [&] {
    check_output(out_dir, opt.overwrite);
    fs::remove_all(part);  // left by a killed run
    fs::create_directories(part);
  });
  // Ends the run on every rank (all call it together), the output as it was when any of them returns.
  auto give_up = [&](const std::string& msg) {
    if (rank == 0) {
      std::error_code ec;
      fs::remove_all(part, ec);
    }
    comm.barrier();
    fail_all(msg);
  };

  int64_t counts[kReasons] = {};
  int64_t records = 0, samples = 0, tokens = 0, supervised = 0, images = 0, shards = 0, videos = 0;
  long fail_line = LONG_MAX;
  std::string fail_msg;
  ShardBuilder builder;
  std::string sums;            // of this rank's shards, for index.json: 16 hex digits each
  int64_t unsupervised = 0;    // samples without a supervised token (no assistant answer)
  auto flush = [&] {
    const std::string path = (part / shard_name(rank, shards)).string();
    builder.write(path, opt.input);
    sums += shard_checksum(path);
    ++shards;
  };
  std::string text;
  long line = 0, record = -1;
  while (std::getline(in, text)) {
    ++line;
    if (blank(text) || ++record % size != rank) continue;
    ++records;
    try {
      Prepared p = prepare_record(text, line, opt, root, tok);
      builder.add(p.enc.input_ids, p.enc.labels, p.images, p.grids, line, p.videos, p.video_grids);
      ++samples;
      tokens += int64_t(p.enc.input_ids.size());
      const int64_t sup = std::count_if(p.enc.labels.begin(), p.enc.labels.end(), [](int32_t l) { return l != -100; });
      supervised += sup;
      if (sup == 0 && unsupervised++ < kWarnLimit)
        log_warn(opt.input + ":" + std::to_string(line) + ": no supervised tokens (no assistant answer): the sample "
                 "teaches nothing");
      images += int64_t(p.images.size());
      videos += int64_t(p.videos.size());
      if (long(builder.samples()) == opt.shard_size) flush();
    } catch (const BadSample& bad) {
      if (!opt.skip_bad) {
        fail_line = line;
        fail_msg = bad.msg;
        break;
      }
      if (std::accumulate(counts, counts + kReasons, int64_t(0)) < kWarnLimit) log_warn("dropped: " + bad.msg);
      ++counts[bad.reason];
    }
  }
  if (builder.samples() > 0) flush();

  // fail mode: every rank reports the bad sample with the smallest line, so the message does not depend on N.
  int64_t first = fail_line;
  comm.all_reduce(&first, 1, DType::I64, ReduceOp::Min);
  if (first != LONG_MAX) {
    int64_t root_rank = fail_line == first ? rank : size;
    comm.all_reduce(&root_rank, 1, DType::I64, ReduceOp::Min);
    comm.broadcast_string(fail_msg, int(root_rank));
    give_up(fail_msg + " (prepare.on_error = \"skip\" drops such samples)");
  }

  std::vector<int64_t> tot{records, samples, tokens, supervised, images, shards, unsupervised, videos};
  tot.insert(tot.end(), counts, counts + kReasons);
  comm.all_reduce(tot.data(), tot.size(), DType::I64, ReduceOp::Sum);
  std::vector<int64_t> per_rank(size_t(size), 0);
  comm.all_gather(&shards, per_rank.data(), 1, DType::I64);
  std::vector<size_t> sum_counts(per_rank.size(), 0), sum_displs(per_rank.size(), 0);
  for (int r = 0; r < size; ++r) sum_counts[size_t(r)] = size_t(per_rank[size_t(r)]) * 16;
  for (int r = 1; r < size; ++r) sum_displs[size_t(r)] = sum_displs[size_t(r - 1)] + sum_counts[size_t(r - 1)];
  std::string all_sums(size_t(tot[5]) * 16, '0');
  comm.all_gatherv(sums.data(), sums.size(), all_sums.data(), sum_counts, sum_displs, DType::U8);

  PrepareSummary sum;
  sum.records = tot[0], sum.samples = tot[1], sum.tokens = tot[2], sum.supervised = tot[3], sum.images = tot[4];
  sum.shards = tot[5], sum.unsupervised = tot[6], sum.videos = tot[7];
  for (int r = 0; r < kReasons; ++r)
    if (tot[8 + r] > 0) sum.dropped[kReasonNames[r]] = tot[8 + r];
  // A dataset that cannot train is refused here, not at the first step.
  if (sum.records == 0) give_up("prepare.input '" + opt.input + "' holds no records (an empty file?)");
  if (sum.samples == 0)
    give_up("prepare.input '" + opt.input + "': all " + std::to_string(sum.records) + " record(s) were dropped: " +
            sum.text());
  if (sum.supervised == 0)
    give_up("prepare.input '" + opt.input + "': none of the " + std::to_string(sum.samples) +
            " sample(s) has a supervised token (no assistant answers): nothing to train on");

  std::string err;
  if (rank == 0) try {
    json list = json::array();
    for (int r = 0, i = 0; r < size; ++r)
      for (long k = 0; k < per_rank[r]; ++k, ++i) {
        const std::string name = shard_name(r, k);
        H5File f = H5File::open((part / name).string());
        list.push_back({{"file", name},
                        {"samples", f.attr_int("/", "samples")},
                        {"tokens", f.attr_int("/", "tokens")},
                        {"images", f.attr_int("/", "images")},
                        {"checksum", all_sums.substr(size_t(i) * 16, 16)}});
      }
    const ImageConfig& ic = opt.image;
    json man = {{"format", "q3vl-dataset"},
                {"version", 1},
                {"source", opt.input},
                {"image_root", root.string()},
                {"ranks", size},
                {"image",
                 {{"patch", ic.patch},
                  {"temporal_patch", ic.temporal_patch},
                  {"merge", ic.merge},
                  {"min_pixels", ic.min_pixels},
                  {"max_pixels", ic.max_pixels},
                  {"min_side", ic.min_side},
                  {"mean", {ic.mean[0], ic.mean[1], ic.mean[2]}},
                  {"std", {ic.std[0], ic.std[1], ic.std[2]}}}},
                {"video",
                 {{"patch", opt.video.patch},
                  {"temporal_patch", opt.video.temporal_patch},
                  {"merge", opt.video.merge},
                  {"fps", opt.video.fps},
                  {"min_frames", opt.video.min_frames},
                  {"max_frames", opt.video.max_frames},
                  {"min_pixels", opt.video.min_pixels},
                  {"max_pixels", opt.video.max_pixels},
                  {"mean", {opt.video.mean[0], opt.video.mean[1], opt.video.mean[2]}},
                  {"std", {opt.video.std[0], opt.video.std[1], opt.video.std[2]}}}},
                {"records", sum.records},
                {"samples", sum.samples},
                {"tokens", sum.tokens},
                {"supervised_tokens", sum.supervised},
                {"unsupervised_samples", sum.unsupervised},
                {"images", sum.images},
                {"videos", sum.videos},
                {"dropped", sum.dropped},
                {"shards", list}};
    {
      std::ofstream o(part / "index.json");
      o << man.dump(1) << "\n";
      o.close();
      if (!o) fail("cannot write " + (part / "index.json").string());
    }
    publish(part, out_dir);
  } catch (const std::exception& e) {
    err = e.what();
  }
  comm.broadcast_string(err, 0);
  if (!err.empty()) give_up(err);
  return sum;
}

int run_prepare(const Deck& deck) {
  PrepareOptions opt;
  opt.input = deck.str("prepare.input");
  opt.image_root = deck.str("prepare.image_root");
  opt.output = deck.str("prepare.output");
  opt.shard_size = long(deck.integer("prepare.shard_size"));
  opt.max_tokens = long(deck.integer("prepare.max_tokens"));
  opt.skip_bad = deck.str("prepare.on_error") == "skip";
  opt.overwrite = deck.boolean("prepare.overwrite");
  opt.image.min_pixels = long(deck.integer("prepare.min_pixels"));
  opt.image.max_pixels = long(deck.integer("prepare.max_pixels"));
  opt.image.min_side = int(deck.integer("prepare.min_side"));
  if (opt.image.min_pixels > opt.image.max_pixels) fail_all("prepare.min_pixels is larger than prepare.max_pixels");
  try {
    opt.video = video_config(deck);
  } catch (const Error& e) {
    fail_all(e.what());
  }
  std::unique_ptr<Tokenizer> tok;
  try {  // every rank reads the same file: the error is collective
    tok = std::make_unique<Tokenizer>(Tokenizer::load(deck.str("tokenizer.path")));
  } catch (const Error& e) {
    fail_all(e.what());
  }
  const PrepareSummary sum = prepare_dataset(opt, *tok, Runtime::get().world());
  log_info(sum.text());
  log_info("dataset: " + (fs::path(opt.output) / "index.json").string());
  return 0;
}

}  // namespace q3vl
