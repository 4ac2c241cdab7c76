// `q3vl prepare`: JSONL conversations + an image folder -> HDF5 shards (data/shards.hpp) and index.json.
// Rank r of N takes the records on lines r+1, r+1+N, ... (blank lines are no records), tokenizes them with the chat
// template (data/chat.hpp), resizes their images as the model will see them, and writes its own shard files
// (shard-rRRRR-KKKKK.h5, prepare.shard_size samples each). Rank 0 then writes index.json listing every shard with
// its checksum (io/checkpoint.hpp's file_checksum, verified when training first reads the shard).
// The dataset is written into <output>.partial and replaces <output> only when complete, like a checkpoint: a
// failed prepare changes nothing. An existing dataset is replaced only with prepare.overwrite = true; a folder
// holding other files is never replaced. An empty input, or one where every sample was dropped or none has a
// supervised token, is an error; samples without supervised tokens are counted and reported.
// A bad record or image (bad JSON or fields, missing, unreadable, too small, aspect ratio beyond 200:1, too many
// tokens) is an error naming the file, the line and the image (on_error = "fail": the first one by line ends the
// run on every rank, and the output is left as it was) or is dropped and counted by reason (on_error = "skip").
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/video_processor.hpp"

namespace q3vl {

class Comm;
class Tokenizer;

struct PrepareOptions {
  std::string input;       // JSONL
  std::string image_root;  // image paths are relative to it (empty: the input's folder)
  std::string output;      // dataset folder
  long shard_size = 1000;  // samples per shard file
  long max_tokens = 0;     // longer samples are bad (0: no limit)
  bool skip_bad = false;   // on_error = "skip"
  bool overwrite = false;  // replace a dataset already in `output`
  ImageConfig image;
  VideoConfig video;  // the run's video settings (video_config); a video part's own settings override them
};

struct PrepareSummary {
  int64_t records = 0, samples = 0, tokens = 0, supervised = 0, images = 0, shards = 0, videos = 0;
  int64_t unsupervised = 0;                // samples without a supervised token (kept, counted, reported)
  std::map<std::string, int64_t> dropped;  // reason -> count (reasons with a count only)
  std::string text() const;                // one line for the log
};

// Collective over `comm`. Returns the same summary on every rank.
PrepareSummary prepare_dataset(const PrepareOptions& opt, const Tokenizer& tok, Comm& comm);

int run_prepare(const Deck& deck);

}  // namespace q3vl
