// Unit-boundary hooks: the Model calls them around every use of a ZeRO unit's parameters (DESIGN.md "Training
// data flow"), so that a ZeRO-3 engine can gather a unit just before it is used, free it right after, and
// reduce-scatter its gradients as soon as they are complete. Calls nest when one computation needs two units
// (the LM head reads the final norm's unit and, when tied, the embeddings' unit): before(a), before(b), after(b),
// after(a). A unit may be used several times per pass; Model::unit_order() lists the before_* calls in order.
#pragma once

namespace q3vl {

struct UnitHooks {
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) = 0;
  virtual void after_forward(int unit) = 0;
  virtual void before_backward(int unit) = 0;  // the unit's grads must be bound (accumulated into) after this
  virtual void after_backward(int unit) = 0;
};

}  // namespace q3vl
