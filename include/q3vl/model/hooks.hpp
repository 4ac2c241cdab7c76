// Unit-boundary hooks: the model (DevModel) calls them around every use of a ZeRO unit's parameters (DESIGN.md
// "Training data flow"), so that ZeRO-3 (parallel/dev_zero.hpp) can gather a unit just before it is used, free it
// right after, and reduce-scatter its gradients as soon as they are complete. Calls nest when one computation needs
// two units (the LM head reads the final norm's unit and, when tied, the embeddings' unit): before(a), before(b),
// after(b), after(a). A unit may be used several times per pass; unit_order() (params.hpp) lists the before_* calls
// in order.
#pragma once
#include <cstdint>
#include <vector>

#include "q3vl/core/dtype.hpp"

namespace q3vl {

struct UnitHooks {
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) = 0;
  virtual void after_forward(int unit) = 0;
  virtual void before_backward(int unit) = 0;  // the unit's grads must be bound (accumulated into) after this
  virtual void after_backward(int unit) = 0;
};

// Expert parallelism seam (DESIGN.md "Expert parallelism"): the MoE block moves rows of tokens to the ranks owning
// their experts and back through this: parallel/expert.hpp's, over MPI (host buffers: the device model on CPU ranks,
// and the test reference's host model) or NCCL (the device model's buffers on GPUs).
// Every rank of the group makes the same calls in the same order, also with no tokens of its own.
struct ExpertExchange {
  virtual ~ExpertExchange() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // All-to-all: send_rows[p] rows of `width` elements (from `send`, in rank order) go to rank p; recv gets
  // recv_rows[p] rows from rank p, in rank order.
  virtual void rows(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                    const std::vector<int64_t>& recv_rows, int64_t width, DType t) = 0;
  // All-to-all of n counts per rank: send[p*n..] goes to rank p, recv[p*n..] comes from rank p.
  virtual void counts(const int64_t* send, int64_t* recv, int64_t n) = 0;
  // Each group rank's gradient scale for the current micro-step: an owner computes its experts' gradients from
  // other ranks' tokens, so it applies their scale (ZeRO scales every other gradient itself).
  virtual const std::vector<double>& scales() const = 0;
  // Rows this rank's experts received (a forward dispatch): the load-balance statistics.
  virtual void note_received(int64_t rows) = 0;
};

}  // namespace q3vl
