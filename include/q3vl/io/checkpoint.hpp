// HDF5 checkpoints (DESIGN.md "File formats"): one file per step, every tensor at its full shape, written
// and read collectively with parallel HDF5, each rank its own elements. Any rank count restarts any
// checkpoint because a rank's elements are named by their flat row-major range in the full tensor, not by
// the rank that wrote them.
#pragma once
#include <mpi.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace q3vl {

// This rank's part of one full-shape fp32 dataset: elements [begin, begin+count) of the row-major flattened
// tensor. count may be 0 (the rank still takes part in the collective calls).
struct CkptSlice {
  std::string dataset;          // "model/<hf name>", "optim/exp_avg/<hf name>", "optim/exp_avg_sq/<hf name>"
  std::vector<int64_t> shape;   // full shape
  int64_t begin = 0, count = 0;
  float* data = nullptr;        // count elements (read fills it, write reads it)
};

struct CkptMeta {
  int64_t step = 0;
  int64_t tokens_seen = 0;
  int world_size = 0;           // ranks that wrote it
  std::string deck_toml;        // resolved deck
  std::string state_json;       // training state: data cursor, schedule position, loss scale, skipped steps...
  std::string build;            // q3vl version + git commit
  std::string hf_config_json;   // the model's HF config.json, so that tools need no other file ("" in older files)
  std::string run_id;           // the training run that wrote it: a fresh run draws one, a resumed run keeps it
                                // ("" in older files); rotation deletes only the writing run's checkpoints
};

// Collective over `comm`. Writes <dir>/step_%08d.h5.partial, flushes, renames to step_%08d.h5, then rewrites
// <dir>/latest (name of the newest complete file) and deletes all but the newest `keep_last` checkpoints.
// Returns the final path.
// File: root attributes format = "q3vl-checkpoint", format_version = 1 (int64), step, tokens_seen,
// world_size (int64; the size of `comm`, whatever meta.world_size says), deck, state_json, build,
// hf_config_json, run_id (variable-length UTF-8; files written before they were kept lack them, and readers
// leave them empty); one contiguous little-endian fp32 dataset per slice, at its full shape, with a uint64
// attribute "checksum" (see ckpt_checksum). Rank 0's meta is the one written. No timestamps: the
// same inputs give the same bytes. Every rank passes the same datasets in the same order, and the ranks'
// counts must add up to each tensor's size (both checked: an error on every rank, nothing published).
// keep_last <= 0 keeps all, and counts only checkpoints of meta.run_id (root attribute run_id): another run's are
// never deleted; the checkpoint just written is always kept; older *.partial files are removed; other files in dir
// are left alone.
std::string write_checkpoint(const std::string& dir, MPI_Comm comm, const CkptMeta& meta,
                             const std::vector<CkptSlice>& slices, int keep_last);

// Root attributes only (any rank; no collective). Errors name the file.
CkptMeta read_checkpoint_meta(const std::string& path);

// Collective. Fills every slice; a missing dataset or a shape that differs is an error naming the first
// such tensor and both shapes.
void read_checkpoint(const std::string& path, MPI_Comm comm, const std::vector<CkptSlice>& slices);

// Full shapes of every dataset under "model/" (for "checkpoint from a different model" checks and tools).
std::map<std::string, std::vector<int64_t>> checkpoint_shapes(const std::string& path);

// train.resume = auto: the newest complete and readable checkpoint in dir ("" if none). Damaged ones
// (truncated, unreadable, missing attributes) are skipped with a warning naming them and why.
// `notes` receives the human-readable story ("resuming from ...", "skipping ... because ...").
std::string find_resume_checkpoint(const std::string& dir, std::vector<std::string>* notes);
// Every complete and structurally sound checkpoint in dir, newest first (the first is find_resume_checkpoint's):
// a resume that finds the newest corrupt inside (a checksum) falls back to the next.
std::vector<std::string> resume_candidates(const std::string& dir, std::vector<std::string>* notes);

// Complete checkpoints in dir written by a run other than run_id (or whose attributes cannot be read), newest first:
// a fresh run refuses such a folder, where its rotation and `latest` would mix with another run's.
std::vector<std::string> other_runs_checkpoints(const std::string& dir, const std::string& run_id);
// checkpoint.overwrite: moves files and `latest` into a new <dir>/replaced.N; returns that folder.
std::string move_checkpoints_aside(const std::string& dir, const std::vector<std::string>& files);

// --- Building blocks, exposed for tests and tools ---

// One hyperslab: start and count per dimension.
struct CkptBox {
  std::vector<int64_t> start, count;
};
// The flat row-major range [begin, begin+count) of a tensor of `shape` as disjoint boxes in row-major
// order (partial leading row, full middle block, partial trailing row, recursively): at most 2*ndim-1.
std::vector<CkptBox> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t count);

// Most elements one rank moves in one collective HDF5 call (default 2^28, 1 GiB of fp32): larger slices
// go in several rounds, which keeps every MPI-IO count far from 2^31. Must be equal on every rank.
void set_checkpoint_io_chunk(int64_t elements);

// Each dataset carries a uint64 attribute "checksum": the sum over its elements of
// mix(mix(flat index) + fp32 bits), mod 2^64. A sum, so every rank adds its own range; read_checkpoint
// verifies it whenever the slices it is given cover the whole tensor.
uint64_t ckpt_checksum(const float* data, int64_t begin, int64_t count);

// The same sum over a whole file's bytes, read as little-endian 32-bit words (the last one zero-padded): what
// dataset shards are checked with (data/shards.hpp). An unreadable file is an error naming it.
uint64_t file_checksum(const std::string& path);

// A complete checkpoint's problem ("" if it looks fine): not HDF5, truncated, not a q3vl checkpoint,
// missing attributes, step attribute differing from the file name, a dataset not fully stored.
std::string checkpoint_problem(const std::string& path);

}  // namespace q3vl
