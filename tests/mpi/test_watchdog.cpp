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

// ZeRO's gathers and hybrid groups run on split communicators: they keep the timeout, and name world ranks.
TEST(Watchdog, SplitKeepsTheTimeoutAndNamesWorldRanks) {
  MpiComm comm{MPI_COMM_WORLD};
  const int n = comm.size(), r = comm.rank();
  comm.set_timeout(0.3);
  auto half = comm.split(r % 2, r);
  EXPECT_EQ(half->timeout(), 0.3);
  if (n < 4) GTEST_SKIP() << "needs 4 ranks";
  half->barrier();  // #1
  const int late = n - 1;  // world rank; in its half it is rank (n - 1) / 2
  if (r % 2 == late % 2) {
    if (r == late) {
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      half->set_timeout(0);
      half->barrier();
    } else {
      try {
        half->barrier();
        ADD_FAILURE() << "expected the watchdog to fire";
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("ranks that did not arrive: " + std::to_string(late) + " (" + std::to_string(late) + " at #1)"),
                  std::string::npos) << m;
        EXPECT_NE(m.find("(rank " + std::to_string(r) + " on "), std::string::npos) << m;
      }
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
