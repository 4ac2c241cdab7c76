// The watchdog names the ranks that did not arrive at a collective, read from the progress board.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <thread>

#include "q3vl/core/error.hpp"
#include "q3vl/runtime/mpi_comm.hpp"

using namespace q3vl;

TEST(Watchdog, NamesTheRankThatDidNotArrive) {
  MpiComm comm{MPI_COMM_WORLD};
  const int n = comm.size(), r = comm.rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const int late = n - 1;
  comm.barrier();  // #1 on every rank
  comm.set_timeout(0.3);
  if (r == late) {
    // Arrives after the others have given up; their abandoned barrier still completes with this one.
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    comm.set_timeout(0);
    comm.barrier();
  } else {
    try {
      comm.barrier();  // #2
      FAIL() << "expected the watchdog to fire";
    } catch (const Error& e) {
      std::string m = e.what();
      EXPECT_FALSE(e.collective());
      EXPECT_NE(m.find("watchdog: collective barrier #2 on a " + std::to_string(n) + "-rank mpi communicator"),
                std::string::npos) << m;
      EXPECT_NE(m.find("ranks that did not arrive: " + std::to_string(late) + " (" + std::to_string(late) +
                       " at #1)"), std::string::npos) << m;
      EXPECT_EQ(m.find("other nodes"), std::string::npos) << m;  // one host: every rank is readable
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(Watchdog, ProgressBoardCountsEachCommunicatorSeparately) {
  MpiComm comm{MPI_COMM_WORLD};
  auto half = comm.split(comm.rank() % 2, comm.rank());
  double x = 1;
  comm.all_reduce(&x, 1, DType::F64);
  comm.barrier();
  half->barrier();
  EXPECT_EQ(comm.begin_collective(), 3);
  EXPECT_EQ(half->begin_collective(), 2);
}
