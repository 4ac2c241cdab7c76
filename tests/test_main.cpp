// GoogleTest main shared by the unit and MPI suites. MPI is initialised for every suite so that library
// code can always ask for its rank. Under several ranks a failure on any rank fails the run, and only
// rank 0 prints: other ranks' failures are forwarded to rank 0 at the end of each test.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

namespace {

// Collects this rank's failure messages during a test, then gathers them on rank 0.
class RankListener : public testing::EmptyTestEventListener {
 public:
  explicit RankListener(int rank, int size) : rank_(rank), size_(size) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      failures_ += std::string(r.file_name() ? r.file_name() : "?") + ":" + std::to_string(r.line_number()) +
                   ": " + r.summary() + "\n";
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    // Every rank runs the same tests in the same order, so this gather is matched.
    int len = static_cast<int>(failures_.size());
    std::vector<int> lens(size_);
    MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    std::vector<int> displs(size_, 0);
    int total = 0;
    for (int i = 0; i < size_; ++i) displs[i] = total, total += lens[i];
    std::string all(total, '\0');
    MPI_Gatherv(failures_.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0,
                MPI_COMM_WORLD);
    if (rank_ == 0) {
      for (int i = 1; i < size_; ++i)
        if (lens[i] > 0)
          ADD_FAILURE() << "rank " << i << " failed in " << info.test_suite_name() << "." << info.name()
                        << ":\n" << all.substr(displs[i], lens[i]);
    }
    failures_.clear();
  }

 private:
  int rank_, size_;
  std::string failures_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto& listeners = testing::UnitTest::GetInstance()->listeners();
  if (size > 1) {
    // Forward before the printer so that rank 0's report includes the other ranks' failures.
    listeners.Append(new RankListener(rank, size));
    if (rank != 0) delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  // The run fails if any rank failed.
  int any = rc != 0;
  MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
