// should_stop(): a trigger seen by one rank stops every rank at the same step boundary.
#include <gtest/gtest.h>
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/runtime/stop.hpp"

using namespace q3vl;

namespace {
struct World {
  MpiComm comm{MPI_COMM_WORLD};
  int r = comm.rank(), n = comm.size();
};

// A directory every rank names the same (rank 0's pid).
std::string shared_dir(Comm& c) {
  int64_t pid = getpid();
  c.broadcast(&pid, 1, DType::I64, 0);
  return "/tmp/q3vl_test_stop_" + std::to_string(pid);
}
}  // namespace

TEST(Stop, NothingToStopFor) {
  World w;
  stop_init(0, shared_dir(w.comm));
  std::string why = "unchanged";
  EXPECT_FALSE(should_stop(w.comm, &why));
  EXPECT_EQ(why, "unchanged");
  EXPECT_EQ(stop_reason(), StopReason::None);
}

TEST(Stop, OneRankSignalledAllRanksAgree) {
  World w;
  for (int sig : {SIGUSR1, SIGTERM}) {
    stop_init(0, "");
    const int victim = std::min(2, w.n - 1);
    if (w.r == victim) raise(sig);  // the handler only sets a flag: the process goes on
    std::string why;
    EXPECT_TRUE(should_stop(w.comm, &why));
    EXPECT_EQ(why, std::string(sig == SIGTERM ? "SIGTERM" : "SIGUSR1") + " received (rank " +
                       std::to_string(victim) + ")");
    EXPECT_EQ(stop_reason(), StopReason::Signal);
    EXPECT_EQ(stop_exit_status(), kExitRequeue);
  }
  // stop_init forgets the signal.
  stop_init(0, "");
  EXPECT_FALSE(should_stop(w.comm));
}

TEST(Stop, StopFileIsSeenByAllRanksAndConsumed) {
  World w;
  std::string dir = shared_dir(w.comm);
  if (w.r == 0) {
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/STOP") << "";
  }
  w.comm.barrier();
  stop_init(0, dir);
  std::string why;
  EXPECT_TRUE(should_stop(w.comm, &why));
  EXPECT_NE(why.find("/STOP found"), std::string::npos) << why;
  EXPECT_EQ(stop_reason(), StopReason::StopFile);
  EXPECT_EQ(stop_exit_status(), kExitRequeue);  // like the signals: checkpoint written, status 3
  w.comm.barrier();
  EXPECT_FALSE(std::filesystem::exists(dir + "/STOP"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/STOP.done"));
  EXPECT_FALSE(should_stop(w.comm));  // consumed: the next run goes on
  w.comm.barrier();
  if (w.r == 0) std::filesystem::remove_all(dir);
}

TEST(Stop, WalltimeLeavesRoomForStepAndCheckpoint) {
  World w;
  stop_init(4.0, "");
  EXPECT_FALSE(should_stop(w.comm));  // 0 s + 5% margin < 4 s
  // One rank's slow step is enough: 1 + 1.5 + 0.2 margin is still < 4 s at t ~ 0 ...
  if (w.r == w.n - 1) stop_note_step(1.0), stop_note_checkpoint(1.5);
  EXPECT_FALSE(should_stop(w.comm));
  // ... but not once 1.5 s have passed.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  std::string why;
  EXPECT_TRUE(should_stop(w.comm, &why));
  EXPECT_EQ(stop_reason(), StopReason::Walltime);
  EXPECT_EQ(stop_exit_status(), kExitRequeue);
  EXPECT_NE(why.find("runtime.walltime = 4 s"), std::string::npos) << why;
  EXPECT_NE(why.find("rank " + std::to_string(w.n - 1)), std::string::npos) << why;
}
