// The distributed loader: one global, seeded sample order that does not depend on the rank count; each
// optimizer step takes the next `global_batch` samples of it; sample k of a step goes to rank k mod N; a rank's
// samples are split into `grad_accum` groups in order and each group is packed (cu_seqlens) into micro-batches
// of at most micro_batch x seq_len tokens, a group that does not fit spilling into extra micro-batches. Every
// rank plans every rank's packing from the sample lengths alone, so all ranks agree on the number of
// micro-steps of a step (the largest; ranks with fewer run empty ones) without communicating.
// Overlong samples (> seq_len tokens) are truncated to seq_len, unless the cut falls inside an image, or
// dropped, as data.overlong says. The cursor (epoch, position in the epoch's order) is all the state there is.
// Prefetch (data.prefetch): prefetch() builds the batch next() will return on a thread of its own while the caller
// computes; the batch is the one next() would build, bit for bit, and the cursor stays the consumed batches' position.
#pragma once
#include <atomic>
#include <cstdint>
#include <future>
#include <string>
#include <vector>

#include "q3vl/data/dataset.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/model/batch.hpp"

namespace q3vl {

struct LoaderOptions {
  int64_t global_batch = 1, micro_batch = 1, grad_accum = 1, seq_len = 4096;
  uint64_t seed = 0;
  bool drop_overlong = false;  // false: truncate
};

struct LoaderCursor {
  int64_t epoch = 0, position = 0;
  bool operator==(const LoaderCursor&) const = default;
};

// One step's share of this rank.
struct StepData {
  std::vector<PackedBatch> micro;   // exactly micro_steps entries; empty ones have no tokens
  std::vector<int64_t> micro_supervised;  // supervised targets of each micro-batch
  std::vector<size_t> samples;      // dataset indices this rank packed, in order
  int64_t tokens = 0;               // tokens in this rank's micro-batches
  int64_t supervised = 0;           // supervised targets in them (labels[s+1] != -100 inside a sample)
  int64_t dropped = 0;              // samples dropped on load (truncation would cut an image)
  double build_seconds = 0;         // host time building it (on the prefetch thread when prefetched)
};

class Loader {
 public:
  Loader(const Dataset& data, const ModelConfig& cfg, const LoaderOptions& opt, int rank, int nranks);
  ~Loader();  // a batch in flight is abandoned: waited for (it stops at its next sample), its result dropped
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;
  // The next global batch's share of this rank; advances the cursor. A prefetched batch is waited for; its build's
  // error (naming the sample or shard) is thrown here, on the caller's thread, as a synchronous build throws it.
  StepData next();
  // Starts building the batch next() returns on a background thread (nothing if one is in flight). The build
  // calls only the dataset (no MPI, no logging). HDF5 is not thread-safe: quiesce() before the caller uses it.
  void prefetch();
  // Waits until the batch in flight, if any, is built; it stays for next().
  void quiesce() const;
  // The position after the batches next() returned, whatever is in flight: what a checkpoint keeps.
  LoaderCursor cursor() const { return cur_; }
  void set_cursor(const LoaderCursor& c);  // drops a batch in flight
  // Dataset indices of the next global batch in order, without advancing (tests).
  std::vector<size_t> peek_global() const;

 private:
  struct Built {
    StepData data;
    LoaderCursor after;
  };
  StepData build(LoaderCursor& c) const;  // the batch at c; advances c
  void drop();
  std::vector<size_t> take_global(LoaderCursor& c) const;
  const std::vector<size_t>& order(int64_t epoch) const;
  int64_t planned_length(size_t index) const;
  bool load(size_t index, Sample& s) const;  // false: dropped

  const Dataset& data_;
  ModelConfig cfg_;
  LoaderOptions opt_;
  int rank_, nranks_;
  LoaderCursor cur_;
  // The order cache is the build's: one build runs at a time (the prefetch thread's or the caller's, never both).
  mutable int64_t order_epoch_ = -1;
  mutable std::vector<size_t> order_;
  std::future<Built> pending_;      // the prefetched batch
  std::atomic<bool> abandon_{false};  // set when pending_'s batch will not be consumed
};

// Supervised targets of one sample (the model's rule: position s counts when labels[s+1] != -100).
int64_t supervised_targets(const std::vector<int64_t>& labels);

// A deterministic synthetic dataset (tests and the demo until the HDF5 shard dataset is wired): sample i is a
// function of (seed, i) alone. Lengths vary in [min_len, max_len]; every `image_every`-th sample carries one image of
// grid (1, g, g), g = image_px / patch (default 64 px: 4 merged tokens) early on; labels supervise the second half, a learnable sequence; plain text ids stay below the special ids.
class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(const ModelConfig& cfg, size_t size, uint64_t seed, int min_len, int max_len, int image_px = 64,
                   int image_every = 3);
  size_t size() const override { return size_; }
  Sample get(size_t index) const override;
  size_t length(size_t index) const override;
  std::string describe(size_t index) const override { return "synthetic sample " + std::to_string(index); }

 private:
  ModelConfig cfg_;
  size_t size_;
  uint64_t seed_;
  int min_len_, max_len_;
  int grid_, image_every_;  // image grid side in patches; 0: no images
};

}  // namespace q3vl
