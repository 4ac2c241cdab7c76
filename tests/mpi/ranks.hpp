// The MPI tests' view of this rank: its node and GPU, and an NCCL communicator for tests that may share one GPU.
#pragma once
#include <mpi.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "q3vl/runtime/nccl_comm.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/tensor/dev.hpp"

namespace q3vl::test {

// Runtime::init is idempotent; the test main initialised MPI.
inline const Placement& placement() {
  int argc = 0;
  char** argv = nullptr;
  return Runtime::init(&argc, &argv).where();
}

// NCCL over `comm` on x's GPU. Ranks that share a GPU (the one-GPU test machine) each name a host of their own
// (NCCL_HOSTID, read at NCCL's first init), which NCCL needs to accept them; it then talks between them over sockets.
inline std::unique_ptr<Comm> test_nccl_comm(MPI_Comm comm, const dev::Exec& x) {
  const Placement& p = placement();
  if (p.local_size > dev::device_count()) setenv("NCCL_HOSTID", ("q3vl-test-" + std::to_string(p.rank)).c_str(), 0);
  return make_nccl_comm(comm, x, 60);
}

}  // namespace q3vl::test
