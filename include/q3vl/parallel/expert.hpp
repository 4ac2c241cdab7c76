// Expert parallelism over MPI (DESIGN.md "Expert parallelism"): the world is cut into EP groups of `ep` consecutive
// ranks; rank r is EP rank r % ep of group r / ep and owns experts [(r % ep)*E/ep, ...) of every MoE layer. The
// ranks with the same EP rank (one per group) hold the same experts: ZeRO shards those experts over them and
// reduces their gradients over them only. Rows move by MPI_Alltoallv on the group (Comm's watchdog covers it), or,
// for a device model on GPUs, over an NCCL communicator of the same ranks (set_rows_comm: device buffers, in order on
// the model's stream); counts always go through the MPI group (host arrays).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "q3vl/model/hooks.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/runtime/comm.hpp"

namespace q3vl {

// "" when `ep` experts-parallel ranks fit `world` ranks and the model's experts, else the reason (names the key).
std::string expert_layout_error(const ModelConfig& cfg, int world, int ep);

class ExpertParallel final : public ExpertExchange {
 public:
  ExpertParallel(Comm& world, int ep);  // collective; fails unless ep divides the world size
  int size() const override { return group_->size(); }
  int rank() const override { return group_->rank(); }
  ExpertSplit split() const { return {size(), rank()}; }
  Comm& group() { return *group_; }
  Comm& replicas() { return *replicas_; }  // the ranks holding this rank's experts
  // The communicator rows() moves rows over instead of the MPI group (null: the group): the same ranks in the same
  // order, e.g. NCCL on the device model's stream. rows() waits for it (under the watchdog). It outlives its use.
  void set_rows_comm(Comm* c);

  void rows(const void* send, const std::vector<int64_t>& send_rows, void* recv,
            const std::vector<int64_t>& recv_rows, int64_t width, DType t) override;
  void counts(const int64_t* send, int64_t* recv, int64_t n) override;
  // This rank's micro-step gradient scale, shared with the group (collective).
  void set_scale(double s);
  const std::vector<double>& scales() const override { return scales_; }
  void note_received(int64_t rows) override { received_ += rows; }

  // Since the last reset: rows this rank's experts received (forward dispatches) and seconds in all-to-alls.
  int64_t received() const { return received_; }
  double seconds() const { return seconds_; }
  void reset_stats() { received_ = 0, seconds_ = 0; }

 private:
  std::unique_ptr<Comm> group_, replicas_;
  Comm* rows_comm_ = nullptr;
  std::vector<double> scales_;
  int64_t received_ = 0;
  double seconds_ = 0;
};

}  // namespace q3vl
