// Parallel HDF5 checkpoints at 1, 2 and 4 ranks: tensors cut at arbitrary points by a ZeRO split are
// written collectively and read back under other splits; metadata, pruning, `latest`, resume past damaged
// files, and refusals of foreign, mismatched and corrupt files.
#include <gtest/gtest.h>
#include <mpi.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "../errors.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/io/checkpoint.hpp"
#include "q3vl/io/h5.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

int rank_of() {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int size_of() {
  int n;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

// Odd sizes, 1-D to 4-D, a scalar, tensors smaller than the rank count, the three dataset families.
std::vector<Tensor> model_tensors() {
  return {{"model/a.weight", {7, 5}},        {"model/b.bias", {3}},           {"model/c", {2, 3, 4}},
          {"model/d", {1}},                  {"model/e", {5, 1, 3, 2}},       {"model/scalar", {}},
          {"model/big", {13, 17}},           {"optim/exp_avg/a.weight", {7, 5}},
          {"optim/exp_avg_sq/a.weight", {7, 5}}};
}

// Element i of tensor t: exact in fp32, signs and magnitudes varied, independent of any split.
float value(size_t t, int64_t i, int salt = 0) {
  uint64_t x = (t + 1) * 1000003ULL + uint64_t(i) * 7919ULL + uint64_t(salt) * 104729ULL;
  x ^= x >> 13;
  x *= 0x9E3779B97F4A7C15ULL;
  return float(int64_t(x % 2000001) - 1000000) / 1024.0f;
}

// Rank r's part of the concatenation of all tensors, as a flat [lo, hi).
using Range = std::pair<int64_t, int64_t>;
int64_t total(const std::vector<Tensor>& ts) {
  int64_t n = 0;
  for (auto& t : ts) n += t.numel();
  return n;
}
// ZeRO: padded to a multiple of the rank count, equal contiguous parts.
Range zero_split(int64_t n_total, int r, int n) {
  int64_t per = (n_total + n - 1) / n;
  return {std::min(n_total, r * per), std::min(n_total, (r + 1) * per)};
}
// Uneven: rank r gets a share proportional to (r+1)^2.
Range uneven_split(int64_t n_total, int r, int n) {
  int64_t w = 0, before = 0;
  for (int q = 0; q < n; ++q) w += (q + 1) * (q + 1);
  for (int q = 0; q < r; ++q) before += (q + 1) * (q + 1);
  return {n_total * before / w, n_total * (before + (r + 1) * (r + 1)) / w};
}
Range all_on_rank0(int64_t n_total, int r, int) { return r == 0 ? Range{0, n_total} : Range{0, 0}; }
Range reversed_zero(int64_t n_total, int r, int n) { return zero_split(n_total, n - 1 - r, n); }

// This rank's slices of each tensor for the flat range, with buffers (filled with values when `fill`).
struct Slices {
  std::vector<std::vector<float>> bufs;
  std::vector<CkptSlice> slices;
};
Slices make_slices(const std::vector<Tensor>& ts, Range range, bool fill, int salt = 0) {
  Slices s;
  s.bufs.resize(ts.size());
  int64_t off = 0;
  for (size_t t = 0; t < ts.size(); ++t) {
    int64_t n = ts[t].numel();
    int64_t lo = std::clamp(range.first - off, int64_t(0), n), hi = std::clamp(range.second - off, int64_t(0), n);
    int64_t count = std::max<int64_t>(hi - lo, 0);
    s.bufs[t].assign(count, -12345.f);
    if (fill)
      for (int64_t j = 0; j < count; ++j) s.bufs[t][j] = value(t, lo + j, salt);
    s.slices.push_back({ts[t].name, ts[t].shape, count ? lo : 0, count, s.bufs[t].data()});
    off += n;
  }
  return s;
}

// Every element read equals the value it was written with.
void expect_values(const std::vector<Tensor>& ts, const Slices& s, int salt = 0) {
  for (size_t t = 0; t < ts.size(); ++t)
    for (int64_t j = 0; j < s.slices[t].count; ++j)
      ASSERT_EQ(s.bufs[t][j], value(t, s.slices[t].begin + j, salt))
          << ts[t].name << " element " << s.slices[t].begin + j;
}

CkptMeta meta_for(int64_t step) {
  CkptMeta m;
  m.step = step;
  m.tokens_seen = step * 4096 + 17;
  m.deck_toml = "[model]\npreset = \"tiny\"\n# naïve — ünïcödé ✓\n";
  m.state_json = "{\"cursor\": " + std::to_string(step * 3) + ", \"loss_scale\": 65536}";
  m.build = "q3vl test";
  m.hf_config_json = "{\"architectures\": [\"Qwen3VLForConditionalGeneration\"], \"x\": \"ü\"}\n";
  return m;
}

// A fresh directory shared by all ranks, removed at the end.
struct TmpDir {
  std::string path;
  TmpDir() {
    std::string p;
    if (rank_of() == 0) {
      char tmpl[] = "/tmp/q3vl_ckpt_XXXXXX";
      p = mkdtemp(tmpl);
    }
    int len = int(p.size());
    MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
    p.resize(len);
    MPI_Bcast(p.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
    path = p;
  }
  ~TmpDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_of() == 0) fs::remove_all(path);
  }
};

std::string step_path(const std::string& dir, int step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "/step_%08d.h5", step);
  return dir + buf;
}

bool contains_note(const std::vector<std::string>& notes, const std::string& a, const std::string& b) {
  for (auto& n : notes)
    if (n.find(a) != std::string::npos && n.find(b) != std::string::npos) return true;
  return false;
}

// Two small tensors, for tests about files rather than values (collectives are slow on shared cores).
std::vector<Tensor> small_tensors() { return {{"model/w", {3, 5}}, {"optim/exp_avg/w", {3, 5}}}; }

void write_steps(const std::string& dir, std::initializer_list<int> steps, int keep_last,
                 const std::vector<Tensor>& ts = model_tensors()) {
  for (int step : steps) {
    Slices w = make_slices(ts, zero_split(total(ts), rank_of(), size_of()), true, step);
    write_checkpoint(dir, MPI_COMM_WORLD, meta_for(step), w.slices, keep_last);
  }
}

}  // namespace

TEST(Checkpoint, RoundTripUnderAnySplit) {
  TmpDir dir;
  auto ts = model_tensors();
  const int r = rank_of(), n = size_of();
  const int64_t T = total(ts);
  Slices w = make_slices(ts, zero_split(T, r, n), true);
  std::string path = write_checkpoint(dir.path, MPI_COMM_WORLD, meta_for(7), w.slices, 3);
  EXPECT_EQ(path, step_path(dir.path, 7));
  EXPECT_TRUE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".partial"));

  for (auto split : {uneven_split, all_on_rank0, reversed_zero}) {
    Slices rd = make_slices(ts, split(T, r, n), false);
    read_checkpoint(path, MPI_COMM_WORLD, rd.slices);
    expect_values(ts, rd);
  }

  auto shapes = checkpoint_shapes(path);
  std::map<std::string, std::vector<int64_t>> want;
  for (auto& t : ts)
    if (t.name.rfind("model/", 0) == 0) want[t.name] = t.shape;
  EXPECT_EQ(shapes, want);
}

TEST(Checkpoint, ManySmallRoundsPerTensor) {
  // A tiny I/O chunk makes every slice take several collective rounds, unequal across ranks.
  TmpDir dir;
  std::vector<Tensor> ts{{"model/e", {5, 1, 3, 2}}, {"model/big", {13, 17}}};
  const int r = rank_of(), n = size_of();
  const int64_t T = total(ts);
  set_checkpoint_io_chunk(16);
  Slices w = make_slices(ts, uneven_split(T, r, n), true, 3);
  std::string path = write_checkpoint(dir.path, MPI_COMM_WORLD, meta_for(3), w.slices, 0);
  Slices rd = make_slices(ts, all_on_rank0(T, r, n), false);
  read_checkpoint(path, MPI_COMM_WORLD, rd.slices);
  set_checkpoint_io_chunk(int64_t(1) << 28);
  expect_values(ts, rd, 3);
}

TEST(Checkpoint, MetadataRoundTrip) {
  TmpDir dir;
  CkptMeta want = meta_for(42);
  for (int i = 0; i < 20000; ++i) want.deck_toml += "# a long resolved deck, line " + std::to_string(i) + "\n";
  auto ts = small_tensors();
  Slices w = make_slices(ts, zero_split(total(ts), rank_of(), size_of()), true);
  write_checkpoint(dir.path + "/", MPI_COMM_WORLD, want, w.slices, 1);  // a trailing slash is fine
  CkptMeta got = read_checkpoint_meta(step_path(dir.path, 42));
  ASSERT_GT(want.deck_toml.size(), 500000u);
  EXPECT_EQ(got.step, 42);
  EXPECT_EQ(got.tokens_seen, want.tokens_seen);
  EXPECT_EQ(got.world_size, size_of());
  EXPECT_EQ(got.deck_toml, want.deck_toml);
  EXPECT_EQ(got.state_json, want.state_json);
  EXPECT_EQ(got.build, want.build);
  EXPECT_EQ(got.hf_config_json, want.hf_config_json);
  H5File f = H5File::open(step_path(dir.path, 42));
  EXPECT_EQ(f.attr_string("/", "format"), "q3vl-checkpoint");
  EXPECT_EQ(f.attr_int("/", "format_version"), 1);
  EXPECT_EQ(checkpoint_problem(step_path(dir.path, 42)), "");
}

// Files written before hf_config_json was kept: the metadata reads (without it), and they resume.
TEST(Checkpoint, FileWithoutHfConfigStillResumes) {
  TmpDir dir;
  auto ts = small_tensors();
  Slices w = make_slices(ts, zero_split(total(ts), rank_of(), size_of()), true);
  const std::string path = write_checkpoint(dir.path, MPI_COMM_WORLD, meta_for(5), w.slices, 0);
  if (rank_of() == 0) {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    EXPECT_GE(H5Adelete(f, "hf_config_json"), 0);
    H5Fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  CkptMeta got = read_checkpoint_meta(path);
  EXPECT_EQ(got.hf_config_json, "");
  EXPECT_EQ(got.deck_toml, meta_for(5).deck_toml);
  EXPECT_EQ(checkpoint_problem(path), "");
  EXPECT_EQ(find_resume_checkpoint(dir.path, nullptr), path);
  Slices rd = make_slices(ts, uneven_split(total(ts), rank_of(), size_of()), false);
  read_checkpoint(path, MPI_COMM_WORLD, rd.slices);
  expect_values(ts, rd);
}

TEST(Checkpoint, SameInputsGiveSameBytes) {
  TmpDir a, b;
  write_steps(a.path, {5}, 1, small_tensors());
  write_steps(b.path, {5}, 1, small_tensors());
  if (rank_of() == 0) {
    std::ifstream fa(step_path(a.path, 5), std::ios::binary), fb(step_path(b.path, 5), std::ios::binary);
    std::string sa((std::istreambuf_iterator<char>(fa)), {}), sb((std::istreambuf_iterator<char>(fb)), {});
    EXPECT_GT(sa.size(), 0u);
    EXPECT_TRUE(sa == sb) << "two writes of the same slices differ in their bytes";
  }
}

TEST(Checkpoint, KeepLastPrunesAndLatestNamesNewest) {
  TmpDir dir;
  const std::string d = dir.path;
  if (rank_of() == 0) {
    std::ofstream(d + "/notes.txt") << "mine";
    std::ofstream(d + "/step_12.h5") << "not ours: too few digits";
    std::ofstream(d + "/step_00000003.h5.partial") << "left by a killed writer";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  write_steps(d, {1, 2, 3, 4, 5}, 2, small_tensors());
  if (rank_of() == 0) {
    std::set<std::string> names;
    for (auto& e : fs::directory_iterator(d)) names.insert(e.path().filename().string());
    EXPECT_EQ(names, (std::set<std::string>{"latest", "notes.txt", "step_12.h5", "step_00000004.h5",
                                            "step_00000005.h5"}));
    std::ifstream in(d + "/latest");
    std::string latest;
    std::getline(in, latest);
    EXPECT_EQ(latest, "step_00000005.h5");
  }
  std::vector<std::string> notes;
  EXPECT_EQ(find_resume_checkpoint(d, &notes), step_path(d, 5));
}

TEST(Checkpoint, ResumeSkipsPartialAndTruncated) {
  TmpDir dir;
  const std::string d = dir.path;
  write_steps(d, {1, 2, 3}, 0, small_tensors());
  if (rank_of() == 0) {
    // Step 3's writer died before the rename; step 2's file lost its tail.
    fs::rename(step_path(d, 3), step_path(d, 3) + ".partial");
    fs::resize_file(step_path(d, 2), fs::file_size(step_path(d, 2)) / 2);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> notes;
  EXPECT_EQ(find_resume_checkpoint(d, &notes), step_path(d, 1));
  EXPECT_TRUE(contains_note(notes, "ignoring", "step_00000003.h5.partial"));
  EXPECT_TRUE(contains_note(notes, "skipping " + step_path(d, 2), "truncated"));
  EXPECT_TRUE(contains_note(notes, "resuming from", step_path(d, 1)));
  // `latest` still names step 3, which was skipped: older is not "newer".
  EXPECT_TRUE(contains_note(notes, "'latest' names step_00000003.h5, which is damaged or missing",
                            "step_00000001.h5 is the newest complete one"));

  auto ts = small_tensors();
  Slices rd = make_slices(ts, zero_split(total(ts), rank_of(), size_of()), false);
  std::string e = error_of([&] { read_checkpoint(step_path(d, 2), MPI_COMM_WORLD, rd.slices); });
  EXPECT_NE(e.find(step_path(d, 2)), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  e = error_of([&] { read_checkpoint_meta(step_path(d, 2)); });
  EXPECT_NE(e.find(step_path(d, 2)), std::string::npos) << e;

  // The next successful write clears the interrupted one.
  write_steps(d, {4}, 0, small_tensors());
  EXPECT_FALSE(fs::exists(step_path(d, 3) + ".partial"));
  EXPECT_EQ(find_resume_checkpoint(d, nullptr), step_path(d, 4));
}

// Rotation deletes only the writing run's checkpoints (issue 33): run "b" writing into run "a"'s folder with
// keep 1 leaves a's files, and other_runs_checkpoints names them; moving them aside keeps their bytes.
TEST(Checkpoint, RotationKeepsOtherRunsAndMovesThemAside) {
  TmpDir dir;
  const std::string d = dir.path;
  auto write_run = [&](const std::string& run, std::initializer_list<int> steps, int keep) {
    for (int step : steps) {
      Slices w = make_slices(small_tensors(), zero_split(total(small_tensors()), rank_of(), size_of()), true, step);
      CkptMeta m = meta_for(step);
      m.run_id = run;
      write_checkpoint(d, MPI_COMM_WORLD, m, w.slices, keep);
    }
  };
  write_run("a", {4, 6}, 1);  // a keeps its newest: step 6
  write_run("b", {1, 2, 3}, 1);
  if (rank_of() == 0) {
    std::set<std::string> names;
    for (auto& e : fs::directory_iterator(d)) names.insert(e.path().filename().string());
    EXPECT_EQ(names, (std::set<std::string>{"latest", "step_00000003.h5", "step_00000006.h5"}));
    EXPECT_EQ(read_checkpoint_meta(step_path(d, 6)).run_id, "a");
    EXPECT_EQ(read_checkpoint_meta(step_path(d, 3)).run_id, "b");
    EXPECT_EQ(other_runs_checkpoints(d, "b"), std::vector<std::string>{step_path(d, 6)});
    EXPECT_EQ(other_runs_checkpoints(d, "a"), std::vector<std::string>{step_path(d, 3)});
    EXPECT_EQ(other_runs_checkpoints(d, "c").size(), 2u);
    const std::string aside = move_checkpoints_aside(d, other_runs_checkpoints(d, "b"));
    EXPECT_EQ(aside, d + "/replaced.1");
    EXPECT_TRUE(fs::exists(aside + "/step_00000006.h5") && fs::exists(aside + "/latest"));
    EXPECT_EQ(read_checkpoint_meta(aside + "/step_00000006.h5").run_id, "a");
    EXPECT_TRUE(other_runs_checkpoints(d, "b").empty());
    EXPECT_EQ(move_checkpoints_aside(d, {}), d + "/replaced.2");  // an earlier replacement stays as it was
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(Checkpoint, StaleLatestLosesToNewerCompleteFile) {
  // A crash between the rename and the update of `latest`.
  TmpDir dir;
  write_steps(dir.path, {1, 2}, 0, small_tensors());
  if (rank_of() == 0) std::ofstream(dir.path + "/latest") << "step_00000001.h5\n";
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> notes;
  EXPECT_EQ(find_resume_checkpoint(dir.path, &notes), step_path(dir.path, 2));
  EXPECT_TRUE(contains_note(notes, "latest", "step_00000002.h5 is newer"));
}

TEST(Checkpoint, EmptyOrMissingDirHasNoResume) {
  TmpDir dir;
  std::vector<std::string> notes;
  EXPECT_EQ(find_resume_checkpoint(dir.path, &notes), "");
  EXPECT_EQ(find_resume_checkpoint(dir.path + "/nope", &notes), "");
}

TEST(Checkpoint, ShapeMismatchNamesTensor) {
  TmpDir dir;
  std::vector<Tensor> ts{{"model/a.weight", {7, 5}}, {"model/c", {2, 3, 4}}};
  write_steps(dir.path, {1}, 0, ts);
  ts[1].shape = {2, 4, 3};  // model/c is [2, 3, 4] in the file
  Slices rd = make_slices(ts, zero_split(total(ts), rank_of(), size_of()), false);
  std::string e = error_of([&] { read_checkpoint(step_path(dir.path, 1), MPI_COMM_WORLD, rd.slices); });
  EXPECT_NE(e.find("written for a different model: tensor model/c has shape [2, 3, 4] in the file, [2, 4, 3] in "
                   "this model"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find(step_path(dir.path, 1)), std::string::npos) << e;

  ts[1].shape = {2, 3, 4};
  ts.push_back({"model/extra.weight", {4}});
  rd = make_slices(ts, zero_split(total(ts), rank_of(), size_of()), false);
  e = error_of([&] { read_checkpoint(step_path(dir.path, 1), MPI_COMM_WORLD, rd.slices); });
  EXPECT_NE(e.find("tensor model/extra.weight is missing from the file (shape [4] in this model)"),
            std::string::npos)
      << e;
}

TEST(Checkpoint, NotACheckpointIsRefused) {
  TmpDir dir;
  const std::string text = dir.path + "/step_00000009.h5", plain = dir.path + "/plain.h5";
  if (rank_of() == 0) {
    std::ofstream(text) << "this is a text file, not HDF5\n";
    H5File::create(plain).write<float>("x", {2}, std::vector<float>{1, 2});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto ts = model_tensors();
  Slices rd = make_slices(ts, zero_split(total(ts), rank_of(), size_of()), false);
  std::string e = error_of([&] { read_checkpoint(text, MPI_COMM_WORLD, rd.slices); });
  EXPECT_NE(e.find("checkpoint '" + text + "': not an HDF5 file"), std::string::npos) << e;
  e = error_of([&] { read_checkpoint_meta(text); });
  EXPECT_NE(e.find("checkpoint '" + text + "': not an HDF5 file"), std::string::npos) << e;
  e = error_of([&] { read_checkpoint(plain, MPI_COMM_WORLD, rd.slices); });
  EXPECT_NE(e.find("checkpoint '" + plain + "': not a q3vl checkpoint"), std::string::npos) << e;
  e = error_of([&] { checkpoint_shapes(dir.path + "/absent.h5"); });
  EXPECT_NE(e.find("absent.h5': no such file"), std::string::npos) << e;

  std::vector<std::string> notes;
  EXPECT_EQ(find_resume_checkpoint(dir.path, &notes), "");
  EXPECT_TRUE(contains_note(notes, "skipping " + text, "not an HDF5 file"));
}

TEST(Checkpoint, FlippedByteIsCaught) {
  TmpDir dir;
  std::vector<Tensor> ts{{"model/b.bias", {3}}, {"model/big", {13, 17}}};
  write_steps(dir.path, {1}, 0, ts);
  const std::string path = step_path(dir.path, 1);
  if (rank_of() == 0) {
    haddr_t off;
    {
      H5File f = H5File::open(path);
      hid_t d = H5Dopen2(f.id(), "model/big", H5P_DEFAULT);
      off = H5Dget_offset(d);
      H5Dclose(d);
    }
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(off + 4 * 100 + 1);
    char c = io.get();
    io.seekp(off + 4 * 100 + 1);
    io.put(char(c ^ 0x10));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Slices rd = make_slices(ts, uneven_split(total(ts), rank_of(), size_of()), false);
  std::string e = error_of([&] { read_checkpoint(path, MPI_COMM_WORLD, rd.slices); });
  EXPECT_NE(e.find("checkpoint '" + path + "' is corrupt: tensor model/big"), std::string::npos) << e;
}

TEST(Checkpoint, BadSlicesAreRefusedOnEveryRank) {
  TmpDir dir;
  auto ts = model_tensors();
  const int r = rank_of(), n = size_of();
  Slices w = make_slices(ts, zero_split(total(ts), r, n), true);
  // A gap: the last element of model/big is nobody's.
  const int64_t big = 6, big_n = 13 * 17;
  if (w.slices[big].count > 0 && w.slices[big].begin + w.slices[big].count == big_n) w.slices[big].count--;
  std::string e = error_of([&] { write_checkpoint(dir.path, MPI_COMM_WORLD, meta_for(1), w.slices, 0); });
  EXPECT_NE(e.find("tensor 'model/big' [13, 17]: the ranks' slices hold 220 of its 221 elements"),
            std::string::npos)
      << e;

  w = make_slices(ts, zero_split(total(ts), r, n), true);
  if (r == n - 1) w.slices[0].begin = 40;  // past the 35 elements of model/a.weight
  e = error_of([&] { write_checkpoint(dir.path, MPI_COMM_WORLD, meta_for(1), w.slices, 0); });
  EXPECT_NE(e.find("tensor 'model/a.weight': slice [40, "), std::string::npos) << e;
  EXPECT_NE(e.find("outside its 35 elements"), std::string::npos) << e;

  if (n > 1) {
    w = make_slices(ts, zero_split(total(ts), r, n), true);
    if (r == 1) w.slices[1].shape = {4};
    e = error_of([&] { write_checkpoint(dir.path, MPI_COMM_WORLD, meta_for(1), w.slices, 0); });
    EXPECT_NE(e.find("different tensor lists"), std::string::npos) << e;
  }
  // Nothing was published.
  EXPECT_EQ(find_resume_checkpoint(dir.path, nullptr), "");
}

// ---- a writer killed mid-write (a real SIGKILL) ----

// Run by the child process only (DISABLED_, so that a normal run neither runs nor counts it as a skip):
// writes step 2 slowly, one element per collective call.
TEST(CheckpointChild, DISABLED_WriteUntilKilled) {
  const char* dir = std::getenv("Q3VL_CKPT_CHILD_DIR");
  ASSERT_TRUE(dir) << "only run as the child of KilledWriterLeavesPreviousCheckpoint";
  set_checkpoint_io_chunk(1);
  std::vector<float> big(1 << 16, 1.5f);
  std::vector<CkptSlice> s{{"model/a", {1 << 16}, 0, 1 << 16, big.data()}};
  write_checkpoint(dir, MPI_COMM_WORLD, meta_for(2), s, 0);
}

TEST(Checkpoint, KilledWriterLeavesPreviousCheckpoint) {
  TmpDir dir;
  write_steps(dir.path, {1}, 0, small_tensors());
  if (rank_of() == 0) {
    // A singleton MPI process of this binary, outside our mpiexec: drop the launcher's variables.
    std::vector<std::string> env_s;
    for (char** e = environ; *e; ++e) {
      std::string v = *e;
      if (v.rfind("PMI_", 0) && v.rfind("MPI_LOCAL", 0) && v.rfind("HYDI_", 0) && v.rfind("HYDRA_", 0))
        env_s.push_back(v);
    }
    env_s.push_back("Q3VL_CKPT_CHILD_DIR=" + dir.path);
    std::vector<char*> envp;
    for (auto& v : env_s) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::string filter = "--gtest_filter=CheckpointChild.DISABLED_WriteUntilKilled";
    char exe[] = "/proc/self/exe", also[] = "--gtest_also_run_disabled_tests";
    char* argv[] = {exe, filter.data(), also, nullptr};
    pid_t pid = fork();
    if (pid == 0) {
      int null = open("/dev/null", O_WRONLY);
      dup2(null, 1);
      dup2(null, 2);
      execve(exe, argv, envp.data());
      _exit(127);
    }
    ASSERT_GT(pid, 0);
    const std::string partial = step_path(dir.path, 2) + ".partial";
    auto t0 = std::chrono::steady_clock::now();
    while (!fs::exists(partial) && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20))
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // into the data
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status)) << "the child finished before it was killed";
    EXPECT_TRUE(fs::exists(partial));
    EXPECT_FALSE(fs::exists(step_path(dir.path, 2)));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> notes;
  EXPECT_EQ(find_resume_checkpoint(dir.path, &notes), step_path(dir.path, 1));
  EXPECT_TRUE(contains_note(notes, "ignoring", "step_00000002.h5.partial"));
  auto ts = small_tensors();
  Slices rd = make_slices(ts, all_on_rank0(total(ts), rank_of(), size_of()), false);
  read_checkpoint(step_path(dir.path, 1), MPI_COMM_WORLD, rd.slices);
  expect_values(ts, rd, 1);
}
