// NcclComm against MpiComm: every collective on the same inputs, NCCL on device buffers, MPI on host ones; the
// watchdog on an NCCL collective a rank never joins. GPU tests (skipped without a GPU, failed by
// Q3VL_REQUIRE_GPU=1). Ranks that share a GPU get distinct NCCL_HOSTIDs, which NCCL needs to accept them (it then
// talks between them as between hosts, over sockets): the GPU machine of the tests has one GPU.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>

#include "../gpu.hpp"
#include "ranks.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/runtime/nccl_comm.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/tensor/dev.hpp"

using namespace q3vl;

using test::placement;

namespace {
struct NcclWorld {
  MpiComm mpi{MPI_COMM_WORLD};
  int r = mpi.rank(), n = mpi.size();
  dev::Exec x;
  std::unique_ptr<Comm> nccl;
  std::vector<void*> bufs;
  NcclWorld() {
    x = dev::make_exec(Device::CUDA, size_t(1) << 20, std::max(0, placement().gpu));
    nccl = test::test_nccl_comm(MPI_COMM_WORLD, x);
  }
  ~NcclWorld() {
    nccl.reset();
    for (void* b : bufs) dev::release(x, b);
    dev::destroy_exec(x);
  }
  template <class T>
  T* up(const std::vector<T>& v, size_t at_least = 0) {
    void* p = dev::alloc(x, std::max<size_t>({v.size(), at_least, 1}) * sizeof(T));
    if (!v.empty()) dev::to_device(x, p, v.data(), v.size() * sizeof(T));
    bufs.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> down(const T* p, size_t n) {
    std::vector<T> v(n);
    if (n) dev::to_host(x, v.data(), p, n * sizeof(T));
    return v;
  }
};
}  // namespace

TEST(NcclGpu, CollectivesEqualMpi) {
  Q3VL_NEED_GPU();
  NcclWorld w;
  EXPECT_EQ(w.nccl->kind(), "nccl");
  EXPECT_EQ(w.nccl->size(), w.n);
  EXPECT_EQ(w.nccl->rank(), w.r);
  // all_gather, with an empty block too
  for (size_t count : {size_t(0), size_t(1), size_t(1001)}) {
    std::vector<float> send(count), want(count * w.n, -1.f);
    for (size_t i = 0; i < count; ++i) send[i] = float(w.r * 10000 + i);
    w.mpi.all_gather(send.data(), want.data(), count, DType::F32);
    float* d = w.up(std::vector<float>(count * w.n, -1.f));
    w.nccl->all_gather(w.up(send), d, count, DType::F32);
    EXPECT_EQ(w.down(d, want.size()), want) << "all_gather of " << count;
  }
  {  // reduce_scatter, all_reduce (Sum, Max, Min; in and out of place)
    const size_t count = 7;
    std::vector<double> send(count * w.n), want(count);
    for (size_t j = 0; j < send.size(); ++j) send[j] = w.r + 0.5 * j;
    w.mpi.reduce_scatter(send.data(), want.data(), count, DType::F64);
    double* d = w.up(std::vector<double>(count));
    w.nccl->reduce_scatter(w.up(send), d, count, DType::F64);
    EXPECT_EQ(w.down(d, count), want);
  }
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
    std::vector<int64_t> v(13);
    for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(i) * (w.r % 2 ? 3 : -2) + w.r;
    int64_t* d = w.up(v);
    w.mpi.all_reduce(v.data(), v.size(), DType::I64, op);
    w.nccl->all_reduce(d, v.size(), DType::I64, op);
    EXPECT_EQ(w.down(d, v.size()), v) << "all_reduce op " << int(op);
  }
  {
    std::vector<float> a(5, 1.5f + w.r), want(5);
    float* out = w.up(want);
    w.mpi.wait(w.mpi.iall_reduce(a.data(), want.data(), 5, DType::F32, ReduceOp::Sum));
    w.nccl->wait(w.nccl->iall_reduce(w.up(a), out, 5, DType::F32, ReduceOp::Sum));
    EXPECT_EQ(w.down(out, 5), want);
  }
  {  // 16-bit floats reduce on NCCL (MPI refuses them): 1 + rank, exact in bf16 and fp16 for small rank counts
    for (DType t : {DType::BF16, DType::F16}) {
      const uint16_t one = t == DType::BF16 ? 0x3F80 : 0x3C00;
      uint16_t* d = w.up(std::vector<uint16_t>(3, one));
      w.nccl->all_reduce(d, 3, t);
      std::vector<float> f(3, 1.f);
      w.mpi.all_reduce(f.data(), 3, DType::F32);
      std::vector<float> got(3);
      std::vector<uint16_t> h = w.down(d, 3);
      for (int i = 0; i < 3; ++i) {
        uint32_t bits = t == DType::BF16 ? uint32_t(h[i]) << 16 : 0;
        float g = 0;
        if (t == DType::BF16) std::memcpy(&g, &bits, 4);
        else g = float(1 << ((h[i] >> 10) - 15)) * (1.f + float(h[i] & 1023) / 1024.f);  // normal fp16 values
        EXPECT_EQ(g, f[i]) << dtype_name(t);
      }
    }
  }
  {  // broadcast from the last rank
    std::vector<int32_t> buf(9, w.r);
    int32_t* d = w.up(buf);
    w.mpi.broadcast(buf.data(), buf.size(), DType::I32, w.n - 1);
    w.nccl->broadcast(d, buf.size(), DType::I32, w.n - 1);
    EXPECT_EQ(w.down(d, buf.size()), buf);
  }
  {  // all_to_all
    const size_t count = 3;
    std::vector<int64_t> send(count * w.n), want(count * w.n);
    for (size_t j = 0; j < send.size(); ++j) send[j] = 1000 * w.r + int64_t(j);
    w.mpi.all_to_all(send.data(), want.data(), count, DType::I64);
    int64_t* d = w.up(std::vector<int64_t>(want.size(), -1));
    w.nccl->all_to_all(w.up(send), d, count, DType::I64);
    EXPECT_EQ(w.down(d, want.size()), want);
  }
  {  // uneven: gatherv, reduce_scatterv (empty blocks included), all_to_allv
    std::vector<size_t> counts(w.n), displs(w.n);
    size_t total = 0;
    for (int q = 0; q < w.n; ++q) counts[q] = q + 2, displs[q] = total, total += counts[q];
    std::vector<float> send(counts[w.r]), want(total, -1.f);
    for (size_t i = 0; i < send.size(); ++i) send[i] = float(100 * w.r + i);
    w.mpi.all_gatherv(send.data(), send.size(), want.data(), counts, displs, DType::F32);
    float* d = w.up(std::vector<float>(total, -1.f));
    w.nccl->all_gatherv(w.up(send), send.size(), d, counts, displs, DType::F32);
    EXPECT_EQ(w.down(d, total), want);

    total = 0;
    for (int q = 0; q < w.n; ++q) counts[q] = (q * 5 + 3) % 4, total += counts[q];
    std::vector<double> s2(total), w2(std::max<size_t>(counts[w.r], 1));
    for (size_t j = 0; j < total; ++j) s2[j] = double(j) * (w.r + 1);
    w.mpi.reduce_scatterv(s2.data(), w2.data(), counts, DType::F64);
    double* d2 = w.up(std::vector<double>(w2.size()));
    w.nccl->reduce_scatterv(w.up(s2), d2, counts, DType::F64);
    EXPECT_EQ(w.down(d2, counts[w.r]), std::vector<double>(w2.begin(), w2.begin() + counts[w.r]));

    auto cnt = [](int a, int b) { return size_t((a + b) % 3); };  // some pairs exchange nothing
    std::vector<size_t> sc(w.n), sd(w.n), rc(w.n), rd(w.n);
    size_t st = 0, rt = 0;
    for (int q = 0; q < w.n; ++q) sc[q] = cnt(w.r, q), sd[q] = st, st += sc[q], rc[q] = cnt(q, w.r), rd[q] = rt, rt += rc[q];
    std::vector<int32_t> s3(st), w3(rt, -1);
    for (size_t j = 0; j < st; ++j) s3[j] = 100 * w.r + int(j);
    w.mpi.all_to_allv(s3.data(), sc, sd, w3.data(), rc, rd, DType::I32);
    int32_t* d3 = w.up(std::vector<int32_t>(rt, -1));
    w.nccl->all_to_allv(w.up(s3), sc, sd, d3, rc, rd, DType::I32);
    EXPECT_EQ(w.down(d3, rt), w3);
  }
  w.nccl->barrier();
  {  // split: a sub-communicator of the even and of the odd ranks
    auto half = w.nccl->split(w.r % 2, w.r);
    EXPECT_EQ(half->kind(), "nccl");
    EXPECT_EQ(half->size(), (w.n + 1 - w.r % 2) / 2);
    EXPECT_EQ(half->world_rank(half->rank()), w.r);
    double* d = w.up(std::vector<double>{double(w.r)});
    half->all_reduce(d, 1, DType::F64);
    double want = 0;
    for (int q = w.r % 2; q < w.n; q += 2) want += q;
    EXPECT_EQ(w.down(d, 1)[0], want);
  }
  {  // two in flight, waited in reverse order
    float* a = w.up(std::vector<float>(4, 1.f));
    float* b = w.up(std::vector<float>(4 * w.n));
    float* c = w.up(std::vector<float>(4, float(w.r)));
    auto r1 = w.nccl->iall_gather(a, b, 4, DType::F32);
    auto r2 = w.nccl->iall_reduce(c, c, 4, DType::F32, ReduceOp::Sum);
    w.nccl->wait(std::move(r2));
    w.nccl->wait(std::move(r1));
    EXPECT_EQ(w.down(b, 4 * w.n), std::vector<float>(4 * w.n, 1.f));
    EXPECT_EQ(w.down(c, 4), std::vector<float>(4, float(w.n * (w.n - 1) / 2)));
  }
}

// A rank that never joins an all_reduce: the others' wait fails within runtime.timeout naming the collective and the
// rank, and aborts the communicator (no kernel left spinning on the GPU).
TEST(NcclGpu, WatchdogNamesTheRankThatDidNotArrive) {
  Q3VL_NEED_GPU();
  NcclWorld w;
  if (w.n < 2) GTEST_SKIP() << "needs 2 ranks";
  float* d = w.up(std::vector<float>(16, 1.f));
  w.nccl->all_reduce(d, 16, DType::F32);  // #2 after init (#1)
  const int late = w.n - 1;
  w.nccl->set_timeout(0.5);
  if (w.r != late) {
    try {
      w.nccl->all_reduce(d, 16, DType::F32);
      ADD_FAILURE() << "expected the watchdog to fire";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("watchdog: collective all_reduce #3 on a " + std::to_string(w.n) + "-rank nccl communicator"),
                std::string::npos) << m;
      EXPECT_NE(m.find("ranks that did not arrive: " + std::to_string(late) + " (" + std::to_string(late) + " at #2)"),
                std::string::npos) << m;
    }
    // Aborted: a later call says so instead of hanging.
    EXPECT_THROW(w.nccl->all_reduce(d, 16, DType::F32), Error);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  w.nccl->abort_inflight();  // the late rank's side of the broken communicator
}
