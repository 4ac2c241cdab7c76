// Comm collectives against values computed independently on every rank; run at 1, 2 and 4 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <numeric>

#include "q3vl/core/error.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/runtime/runtime.hpp"

using namespace q3vl;

namespace {
struct World {
  MpiComm comm{MPI_COMM_WORLD};
  int r = comm.rank(), n = comm.size();
};
}  // namespace

TEST(Comm, AllGather) {
  World w;
  for (size_t count : {size_t(0), size_t(1), size_t(5), size_t(1001)}) {
    std::vector<float> send(count), recv(count * w.n, -1.f);
    for (size_t i = 0; i < count; ++i) send[i] = float(w.r * 10000 + i);
    w.comm.all_gather(send.data(), recv.data(), count, DType::F32);
    for (int q = 0; q < w.n; ++q)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(recv[q * count + i], float(q * 10000 + i));
  }
}

TEST(Comm, ReduceScatterSum) {
  World w;
  const size_t count = 7;
  std::vector<double> send(count * w.n), recv(count);
  for (size_t j = 0; j < send.size(); ++j) send[j] = w.r + 0.5 * j;
  w.comm.reduce_scatter(send.data(), recv.data(), count, DType::F64);
  double rank_sum = w.n * (w.n - 1) / 2.0;
  for (size_t i = 0; i < count; ++i) EXPECT_DOUBLE_EQ(recv[i], rank_sum + w.n * 0.5 * (w.r * count + i));
}

TEST(Comm, AllReduceOps) {
  World w;
  std::vector<float> f(13);
  for (size_t i = 0; i < f.size(); ++i) f[i] = float(w.r + i);
  w.comm.all_reduce(f.data(), f.size(), DType::F32, ReduceOp::Sum);
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(f[i], float(w.n * (w.n - 1) / 2 + w.n * i));
  std::vector<int64_t> v{int64_t(w.r), -int64_t(w.r)};
  w.comm.all_reduce(v.data(), 2, DType::I64, ReduceOp::Max);
  EXPECT_EQ(v[0], w.n - 1);
  EXPECT_EQ(v[1], 0);
  EXPECT_EQ(w.comm.min(double(w.r)), 0.0);
  EXPECT_EQ(w.comm.max(double(w.r)), double(w.n - 1));
  EXPECT_EQ(w.comm.sum(1.0), double(w.n));
  // Out of place.
  std::vector<double> a{1.0 + w.r}, b{0};
  w.comm.wait(w.comm.iall_reduce(a.data(), b.data(), 1, DType::F64, ReduceOp::Sum));
  EXPECT_EQ(b[0], w.n + w.n * (w.n - 1) / 2.0);
  // Reductions on 16-bit floats are refused rather than silently wrong.
  uint16_t h = 0;
  EXPECT_THROW(w.comm.all_reduce(&h, 1, DType::BF16), Error);
}

TEST(Comm, BroadcastFromLastRank) {
  World w;
  std::vector<int32_t> buf(9, w.r);
  w.comm.broadcast(buf.data(), buf.size(), DType::I32, w.n - 1);
  for (auto x : buf) EXPECT_EQ(x, w.n - 1);
  std::string s = w.r == 0 ? std::string("hello from rank 0 \0 with nul", 28) : "";
  w.comm.broadcast_string(s, 0);
  EXPECT_EQ(s, std::string("hello from rank 0 \0 with nul", 28));
}

TEST(Comm, AllToAll) {
  World w;
  const size_t count = 3;
  std::vector<int64_t> send(count * w.n), recv(count * w.n);
  for (int q = 0; q < w.n; ++q)
    for (size_t i = 0; i < count; ++i) send[q * count + i] = 1000 * w.r + 10 * q + int64_t(i);
  w.comm.all_to_all(send.data(), recv.data(), count, DType::I64);
  for (int q = 0; q < w.n; ++q)
    for (size_t i = 0; i < count; ++i) EXPECT_EQ(recv[q * count + i], 1000 * q + 10 * w.r + int64_t(i));
}

TEST(Comm, UnevenAllGatherv) {
  World w;
  // Rank q contributes q+2 elements: totals that do not divide evenly by the rank count.
  std::vector<size_t> counts(w.n), displs(w.n);
  size_t total = 0;
  for (int q = 0; q < w.n; ++q) counts[q] = q + 2, displs[q] = total, total += counts[q];
  std::vector<float> send(counts[w.r]), recv(total, -1.f);
  for (size_t i = 0; i < send.size(); ++i) send[i] = float(100 * w.r + i);
  w.comm.all_gatherv(send.data(), send.size(), recv.data(), counts, displs, DType::F32);
  for (int q = 0; q < w.n; ++q)
    for (size_t i = 0; i < counts[q]; ++i) EXPECT_EQ(recv[displs[q] + i], float(100 * q + i));
}

TEST(Comm, UnevenReduceScatterv) {
  World w;
  std::vector<size_t> counts(w.n);
  size_t total = 0;
  for (int q = 0; q < w.n; ++q) counts[q] = (q * 5 + 3) % 4, total += counts[q];  // includes empty blocks
  std::vector<double> send(total), recv(std::max<size_t>(counts[w.r], 1));
  for (size_t j = 0; j < total; ++j) send[j] = double(j) * (w.r + 1);
  w.comm.reduce_scatterv(send.data(), recv.data(), counts, DType::F64);
  size_t off = 0;
  for (int q = 0; q < w.r; ++q) off += counts[q];
  double factor = w.n * (w.n + 1) / 2.0;
  for (size_t i = 0; i < counts[w.r]; ++i) EXPECT_DOUBLE_EQ(recv[i], double(off + i) * factor);
}

TEST(Comm, UnevenAllToAllv) {
  World w;
  // Rank a sends (a+b)%3+1 elements to rank b.
  auto cnt = [](int a, int b) { return size_t((a + b) % 3 + 1); };
  std::vector<size_t> sc(w.n), sd(w.n), rc(w.n), rd(w.n);
  size_t st = 0, rt = 0;
  for (int q = 0; q < w.n; ++q) {
    sc[q] = cnt(w.r, q), sd[q] = st, st += sc[q];
    rc[q] = cnt(q, w.r), rd[q] = rt, rt += rc[q];
  }
  std::vector<int32_t> send(st), recv(rt, -1);
  for (int q = 0; q < w.n; ++q)
    for (size_t i = 0; i < sc[q]; ++i) send[sd[q] + i] = 100 * w.r + 10 * q + int(i);
  w.comm.all_to_allv(send.data(), sc, sd, recv.data(), rc, rd, DType::I32);
  for (int q = 0; q < w.n; ++q)
    for (size_t i = 0; i < rc[q]; ++i) EXPECT_EQ(recv[rd[q] + i], 100 * q + 10 * w.r + int(i));
}

TEST(Comm, SplitEvenOdd) {
  World w;
  auto sub = w.comm.split(w.r % 2, w.r);
  EXPECT_EQ(sub->size(), (w.n + 1 - w.r % 2) / 2);
  EXPECT_EQ(sub->rank(), w.r / 2);
  double s = sub->sum(double(w.r));
  double want = 0;
  for (int q = w.r % 2; q < w.n; q += 2) want += q;
  EXPECT_EQ(s, want);
}

TEST(Comm, NonblockingOverlap) {
  World w;
  // Two collectives in flight at once, completed in reverse order.
  std::vector<float> a(4, 1.f), b(4 * w.n);
  std::vector<float> c(4, float(w.r));
  auto r1 = w.comm.iall_gather(a.data(), b.data(), 4, DType::F32);
  auto r2 = w.comm.iall_reduce(c.data(), c.data(), 4, DType::F32, ReduceOp::Sum);
  w.comm.wait(std::move(r2));
  w.comm.wait(std::move(r1));
  for (float x : b) EXPECT_EQ(x, 1.f);
  for (float x : c) EXPECT_EQ(x, float(w.n * (w.n - 1) / 2));
}

namespace {
// A collective some rank never joins.
struct NeverDone : CommRequest {
  NeverDone() : CommRequest("all_gather") {}
  bool test() override { return false; }
};
}  // namespace

TEST(Comm, WatchdogNamesTheCollectiveAndStep) {
  World w;
  w.comm.set_timeout(0.05);
  Comm::set_step(42);
  auto t0 = std::chrono::steady_clock::now();
  try {
    w.comm.wait(std::make_unique<NeverDone>());
    FAIL() << "expected the watchdog to fire";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("watchdog: collective all_gather"), std::string::npos) << m;
    EXPECT_NE(m.find("at step 42"), std::string::npos) << m;
    EXPECT_NE(m.find("rank " + std::to_string(w.r)), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  Comm::set_step(-1);
}

TEST(Runtime, PlacementIsConsistent) {
  int argc = 0;
  char** argv = nullptr;
  Runtime& rt = Runtime::init(&argc, &argv);
  const Placement& p = rt.where();
  World w;
  EXPECT_EQ(p.rank, w.r);
  EXPECT_EQ(p.size, w.n);
  EXPECT_GE(p.local_rank, 0);
  EXPECT_LT(p.local_rank, p.local_size);
  EXPECT_EQ(rt.world().sum(1.0), double(w.n));
  // All test ranks run on one host: one node, local ranks 0..n-1.
  EXPECT_EQ(p.nodes, 1);
  EXPECT_EQ(p.local_size, w.n);
  EXPECT_EQ(rt.world().sum(double(p.local_rank)), w.n * (w.n - 1) / 2.0);
}

TEST(Runtime, DeckBroadcastAndCollectiveErrors) {
  int argc = 0;
  char** argv = nullptr;
  Runtime& rt = Runtime::init(&argc, &argv);
  // Only rank 0 reads the file; others must end up with rank 0's resolved values.
  std::string path = "/tmp/q3vl_test_deck_" + std::to_string(getpid()) + ".toml";
  if (rt.where().rank == 0) {
    FILE* f = fopen(path.c_str(), "w");
    fputs("[train]\nlr = 0.25\n", f);
    fclose(f);
  }
  Deck d = rt.load_deck(path, {"train.steps=9"}, "check");
  EXPECT_DOUBLE_EQ(d.real("train.lr"), 0.25);
  EXPECT_EQ(d.integer("train.steps"), 9);
  // A bad deck: every rank throws the same collective error.
  try {
    rt.load_deck(path, {"train.steps=-1"}, "check");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.collective());
    EXPECT_NE(std::string(e.what()).find("train.steps = -1 is out of range"), std::string::npos) << e.what();
  }
  rt.world().barrier();
  if (rt.where().rank == 0) remove(path.c_str());
}
