// Comm over NCCL on device buffers (comm.hpp's seam). Collectives run on the stream of the Exec it was made for, in
// order with that Exec's kernels; a request completes when an event recorded after it has passed. The communicator
// is nonblocking (ncclCommInitRankConfig, blocking = 0), so init, enqueue and completion all wait in Comm::wait under
// runtime.timeout, and a timeout aborts the communicator (ncclCommAbort) before the job is taken down. Ranks that
// did not arrive are named from a ProgressBoard of the bootstrap MPI communicator, as MpiComm does.
#pragma once
#include <mpi.h>

#include <memory>

#include "q3vl/runtime/comm.hpp"
#include "q3vl/tensor/dev.hpp"

namespace q3vl {

// Collective over `bootstrap` (its ranks become the NCCL ranks, in order); `x` is a CUDA Exec on the rank's GPU.
// Ranks of one communicator need distinct GPUs (NCCL refuses two on one device unless NCCL_HOSTID tells them apart).
// A build without CUDA fails here.
std::unique_ptr<Comm> make_nccl_comm(MPI_Comm bootstrap, const dev::Exec& x, double timeout);

// The NCCL library's version as "2.28.3", or "none" in a build without CUDA.
std::string nccl_version();

}  // namespace q3vl
