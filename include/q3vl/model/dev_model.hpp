// Qwen3-VL on the device op layer: the whole forward and backward (vision tower, mergers, DeepStack, decoder, final
// norm, chunked LM head + loss, aux loss) on an Exec, with weights in the compute dtype and F32 gradients in device
// buffers, every activation carved from one arena sized by reserve() before the first step. On the CPU in fp32 it
// computes what the test reference's host model computes (tests/reference/, tests/unit/test_dev_model.cpp); on CUDA
// it is the GPU model.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/model/batch.hpp"
#include "q3vl/model/dev_layers.hpp"
#include "q3vl/model/hooks.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/positions.hpp"
#include "q3vl/model/weights.hpp"
#include "q3vl/runtime/comm.hpp"

namespace q3vl {

// model.dtype's names: fp32, bf16, fp16.
DType compute_dtype(const std::string& name);

// Token and patch budget of one forward: what the arena is sized for.
struct DevBudget {
  int64_t tokens = 0, patches = 0, segments = 0;  // segments: packed samples
  int ep = 1;  // expert parallelism: the group's size (an owner's experts get up to ep x tokens x top-k rows)
};

// Bytes a DevModel allocates on its device, by kind (the memory report; the planner's sizing).
struct DevMemory {
  int64_t weights = 0, grads = 0, activations = 0, workspace = 0;
  int64_t total() const { return weights + grads + activations + workspace; }
};

// A pipeline stage (serve.pp): decoder layers [l0, l1) (l1 < 0: to the end), with `first` the embeddings and the
// vision tower, with `last` the final norm and the LM head (a tied head: the embeddings too). Default: everything.
struct DevStage {
  int l0 = 0, l1 = -1;
  bool first = true, last = true;
  bool whole() const { return l0 == 0 && l1 < 0 && first && last; }
  // Stage s of `stages` equal shares of `layers` decoder layers (serve.pp: serve and the planner cut alike).
  static DevStage of(int s, int stages, int layers) {
    return {layers * s / stages, s + 1 == stages ? -1 : layers * (s + 1) / stages, s == 0, s + 1 == stages};
  }
};

// How a training model holds its weights and gradients for ZeRO (parallel/dev_zero.hpp): each unit padded to a
// multiple of `group` elements, so that an all-gather of `group` equal shards lands in place and a reduce-scatter
// reads equal blocks; `full` = false (ZeRO-3): no storage at all, each unit's weights and gradients are bound
// (bind_unit) by the unit hooks only while the unit is in use.
struct DevHold {
  int group = 1;
  bool full = true;
};

class DevModel {
 public:
  // grads = false: inference only (serve), no gradient buffer. A stage (inference only) holds only its units. quant
  // (inference only; model.weight_dtype = "int8" or "fp8"): the linears quant_param names are held as 8-bit rows in
  // that format with fp32 scales (quantized on the host as the weights arrive, ops::quantize_rows: what the host
  // model's int8/fp8 mode does to the same matrices).
  // ep: this rank's share of the MoE experts (the table then holds E/ep experts of each MoE layer): in training with
  // set_experts (expert parallelism, rows exchanged); in inference (serve.ep) the rank runs the rows the whole router
  // sends to its experts, the others' outputs arriving with the tensor-parallel sum after the block.
  DevModel(const ModelConfig& cfg, const dev::Exec& ex, DType dt, bool grads = true, DevStage stage = {},
           QFormat quant = QFormat::None, DevHold hold = {}, ExpertSplit ep = {});
  // The linears held in 8 bits with model.weight_dtype = "int8" or "fp8": the decoder's q/k/v/o_proj, dense
  // gate/up/down_proj, MoE experts' gate_up/down, and an untied LM head. The router, norms, embeddings (a tied head)
  // and the vision tower stay in dt.
  static bool quant_param(const ParamTable& t, int id);
  // Its 8-bit rows, one fp32 scale each: every row of the last dim (an expert tensor [E, out, in] has E * out).
  static int64_t quant_rows(const ParamInfo& p);
  ~DevModel();
  DevModel(const DevModel&) = delete;
  DevModel& operator=(const DevModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  DType dtype() const { return dt_; }
  const dev::Exec& exec() const { return ex_; }

  // Activation recomputation per block (train.recompute = "block"), set before reserve(): forward keeps only each
  // decoder layer's and ViT block's input; backward reruns that block into one shared context just before its
  // backward (the same ops on the same inputs: bitwise the same activations).
  void set_recompute(bool on);
  // Expert parallelism: the exchange (its buffers device pointers: NCCL on GPUs, MPI on CPU ranks) that moves rows
  // to the owners of their experts; set before reserve(), whose budget's ep is its size. It outlives the model.
  void set_experts(ExpertExchange* ex);
  // A rank without tokens in a micro-step still serves the others' rows with its experts: the MoE layers' exchanges
  // (forward, or backward: recomputed forward first under recomputation) with no rows of its own.
  void idle_pass(bool backward);
  bool recompute() const { return recompute_; }
  // Sizes and allocates every activation, context and scratch buffer for forwards within `b` (throws naming the
  // budget when a batch exceeds it). Called once; the memory is then fixed.
  void reserve(const DevBudget& b);
  DevMemory memory() const;
  // What reserve(b) would allocate for activations, without allocating (the planner's sizing).
  static int64_t activation_bytes(const ModelConfig& cfg, DType dt, const DevBudget& b, bool recompute = false);
  // What the constructor allocates: the weights in dt and the fp32 gradients, both full (the planner's sizing); quant:
  // the quant_param linears one byte a weight and 4 a row, whichever the format.
  static int64_t weight_bytes(const ParamTable& t, DType dt, const DevStage& s = {}, QFormat quant = QFormat::None);
  // Whether a stage holds unit u of the table.
  static bool stage_owns(const ParamTable& t, const DevStage& s, int u);
  const DevStage& stage() const { return stage_; }
  static int64_t grad_bytes(const ParamTable& t) { return t.total() * 4; }

  // Weights in the compute dtype, table order (unit offsets as in ParamTable): from fp32 host values (the full
  // table, or one unit). Training fills them through ZeRO (parallel/dev_zero.hpp) instead.
  void set_params(const float* host_all);
  // Table elements [offset, offset + n) from fp32 host values (a unit at a time: the streamed load of serve).
  void set_params(int64_t offset, const float* host, int64_t n);
  void* params() { return params_; }
  // The gradients, every one holding its sum so far (fresh ones zeroed first: settle_grads).
  float* grads() {
    settle_grads();
    return grads_;
  }
  // A new step's gradients: marked fresh, not filled. A fresh gradient holds nothing yet: the first op to produce it
  // writes it (linear_bwd's and grouped_linear_bwd's accumulate_dW = false: no zero-fill and no read of it), the later
  // ones add (DevParams::fresh, dev_grad_adds). Whatever reads the buffers settles them first.
  void zero_grads();
  // Zeroes the gradients still fresh (nothing produced them since zero_grads or a fresh bind): before anything reads
  // the buffers (backward's end, grads(), grads_to_host, unbinding a unit).
  void settle_grads();
  // Training: an op that writes a gradient fresh also adds the gradient's sum of squares into slot id of sum and bad
  // (dev::SumSq; device arrays of one element a parameter, which the caller owns and zeroes; null, null: off), so the
  // step's gradient norm need not read it again. Forgets what was taken before. The experts' weight gradients take
  // them (grouped_linear_bwd); the other ops do not.
  void take_grad_squares(double* sum, int32_t* bad);
  // [id] the gradient (the parameter's held elements) whose squares slot id holds, or null: none taken since
  // take_grad_squares, or an op added to it after (dev_grad_out).
  const std::vector<const float*>& grad_squares_taken() const { return sq_at_; }
  // ZeRO. The hooks (model/hooks.hpp) around every use of a unit's weights, in unit_order()'s order; a unit's
  // weights (dt) and gradients (F32; null: none computed) read from and accumulated into these buffers while bound,
  // laid out as the unit's ParamInfo::offset says (null, null: unbound). fresh: the gradients hold nothing yet (as
  // after zero_grads: the first op to produce each writes it); a unit's fresh gradients are zeroed when it is bound
  // again or unbound, before anyone else reads them.
  void set_hooks(UnitHooks* h) { hooks_ = h; }
  void bind_unit(int u, const void* params, float* grads, bool fresh = false);
  // Where unit u starts in params() and grads() (elements: units padded to the hold's group), and a padded size.
  int64_t unit_base(int u) const { return ubase_[size_t(u)]; }
  int64_t held() const { return held_; }
  static int64_t padded(int64_t numel, int group) { return (numel + group - 1) / group * group; }
  void grads_to_host(float* host_all);

  double forward(const Batch& b, bool keep, std::vector<float>* logits_out = nullptr, double* aux_out = nullptr,
                 bool aux_loss = false);
  double forward(const PackedBatch& b, bool keep, std::vector<float>* logits_out = nullptr,
                 double* aux_out = nullptr, bool aux_loss = false);
  // Accumulates the gradient of the last kept forward's loss (times loss_scale: fp16 loss scaling) into grads().
  void backward(float loss_scale = 1.f);
  // Training (DevTrainer): a kept forward without logits_out stops after the decoder and returns NaN; the final norm,
  // the LM head and the loss run at the start of backward(), each chunk's logits computed once for the loss and its
  // gradient (not once in each pass), and loss() reads the loss after it. ZeRO-3's forward order then has no head
  // (unit_order's head_in_forward). Eval, logits_out and forward(keep = false) are unchanged.
  void set_loss_in_backward(bool on) { loss_in_bwd_ = on; }
  bool loss_in_backward() const { return loss_in_bwd_; }
  // The last pass's loss (as forward returns it) and aux loss: after a forward, or after the backward of a forward
  // whose head was deferred. Reads the device's sums: waits for the pass.
  double loss(double* aux_out = nullptr);
  int64_t supervised_tokens() const { return count_; }
  // LoRA (cfg.lora.on()): the adapters' run state; set train, seed and nonce (the dropout mask's key) before a
  // forward, as model/lora.hpp's LoraRun. The adapters are parameters of the table like any other.
  DevLora& lora();
  // Parameters without gradients (a LoRA base, train.tune_* = false): their gradient pointers stay null, so no
  // weight gradient is computed for them; the ZeRO hold's buffers still have their place.
  void set_frozen(const std::vector<bool>& trainable);

  // ---- Inference (generate, serve): continuous-batching steps and vision features ----------------------------------
  // A step of up to `tokens` new tokens in up to `segments` segments, a vision pass of up to `patches` patches, and
  // the KV pools: kv_blocks blocks of `block` tokens per layer, a sequence spanning at most seq_blocks blocks.
  // The workspace of an inference Exec (serve, generate): cuBLASLt, the attention splits, 8-bit weight tiles.
  static constexpr size_t kInferWorkspace = size_t(256) << 20;
  struct InferBudget {
    int64_t tokens = 0, segments = 0, patches = 0, kv_blocks = 0, block = 16, seq_blocks = 0;
  };
  // Bytes reserve_infer(b) allocates: the KV pools and the step and vision buffers (serve sizes its cache with it).
  static int64_t kv_pool_bytes(const ModelConfig& cfg, DType dt, int64_t blocks, int64_t block, const DevStage& s = {});
  static int64_t infer_bytes(const ModelConfig& cfg, DType dt, const InferBudget& b, const DevStage& s = {});
  void reserve_infer(const InferBudget& b);
  // cache: the block tables (blocks of the budget's size, ids within its pools), where each segment's sequence already
  // holds room for its tokens (the engine's block manager reserves them); the keys and values are in this model's
  // pools. The step appends the tokens to their sequences (len, next_pos). Returns each segment's last-row logits [segs, V] (V: the tensor-parallel rows).
  // A pipeline stage after the first takes the previous stage's hidden states x_in [N, H] (fp32, host); one before
  // the last returns nothing and leaves its output in x_out.
  // Greedy steps (`best`): instead of the logits, each segment's first maximum over this rank's vocabulary rows among
  // ids below `limit` and not `banned` (sample_token at temperature 0): its id (-1: none of this rank's rows) and
  // logit. Then [segs, V] never leaves the device.
  static constexpr int kMaxBanned = 16;
  struct Argmax {
    int64_t limit = 0;
    std::vector<int64_t> banned;
    std::vector<int32_t> id;  // out, [segs]
    std::vector<float> val;   // out, [segs]
  };
  std::vector<float> step(const std::vector<StepSegment<float>>& segs, KvTable& cache,
                          const std::vector<float>* x_in = nullptr, std::vector<float>* x_out = nullptr,
                          Argmax* best = nullptr);
  // The vision tower and mergers for one prompt's images: img [n, H] and ds [deepstack][n*H] on the host.
  void vision_features(const std::vector<float>& pixels, const std::vector<int64_t>& grid, std::vector<float>& img,
                       std::vector<std::vector<float>>& ds);
  // One prompt's part of a batched vision pass: its pixels and grid in, its img and ds out (as above).
  struct VisionJob {
    const std::vector<float>* pixels;
    const std::vector<int64_t>* grid;
    std::vector<float>* img;
    std::vector<std::vector<float>>* ds;
  };
  // Several prompts' images in one pass, their patches one after the other (at most vision_budget() in all): the
  // attention stays within each image (and temporal group) and every other op of the tower and mergers works row by
  // row, so each prompt gets what a pass of its own gives.
  void vision_features(const std::vector<VisionJob>& jobs);
  int64_t vision_budget() const;  // patches one vision pass may take (InferBudget::patches)
  // Where a step's host time goes (serve.profile_steps): with `p` set, steps run op by op (no graph), wait for the
  // device after its work, and add their phases' wall seconds to *p; null: off.
  struct StepPhases {
    double pack = 0, upload = 0, device = 0, download = 0;
  };
  void set_step_phases(StepPhases* p);
  // Tensor parallelism (a tp_config slice): `comm` (the group; it outlives the model) adds the partial outputs of the
  // group: an NCCL one on the device buffers in the model's dtype, in order on the stream (a step waits once, at its
  // end, under the watchdog); an MPI one in fp32 through the host. The head computes vocabulary rows [v0, v1).
  void set_tensor_parallel(Comm* comm, int64_t v0, int64_t v1);
  // Decode steps (every segment one new token, no image rows) padded to a bucket of segments (decode_bucket), so
  // that their sizes repeat, and on a GPU recorded once per bucket as a graph that later steps replay (model.
  // cuda_graphs). Not with a tensor-parallel group that sums through the host. Padding runs on the CPU op layer too,
  // where the tests check it.
  void set_graphs(bool on);
  static int64_t decode_bucket(int64_t segments, int64_t most);
  int64_t graphs_recorded() const;

 private:
  struct Impl;
  struct Infer;
  // reserve() and activation_bytes() size the arena here, the one place.
  static size_t size_arena(Impl& i, const ModelConfig& cfg, DType dt, const DevBudget& b, bool recompute);
  double run(TokenStream&& s, const std::vector<float>& pixels, const std::vector<int64_t>& grid, bool keep,
             std::vector<float>* logits_out, double* aux_out, bool aux_loss);

  ModelConfig cfg_;
  ParamTable table_;
  dev::Exec ex_;
  DType dt_;
  DevStage stage_;
  std::vector<int64_t> par_off_;  // [id] its place in params_ (elements) or in q8_, -1 when the stage does not hold it
  std::vector<int64_t> scl_off_;  // [id] its first scale in s8_ (8-bit weights), else -1
  std::vector<int64_t> ubase_;    // [unit] its first element in params_ and grads_, -1 when not held
  DevHold hold_;
  UnitHooks* hooks_ = nullptr;
  std::vector<bool> trainable_;  // empty: every parameter has gradients
  bool frozen(int id) const { return !trainable_.empty() && !trainable_[size_t(id)]; }
  ExpertExchange* ep_ = nullptr;
  void enter(int id, bool bwd);  // the hooks around a use of the unit holding parameter id
  void leave(int id, bool bwd);
  void enter_layer(int l, bool bwd);
  void leave_layer(int l, bool bwd);
  void enter_head(bool bwd);
  void leave_head(bool bwd);
  int64_t held_ = 0, held8_ = 0, rows8_ = 0;  // elements in params_, in q8_, scales in s8_
  QFormat qf_ = QFormat::None;                 // q8_'s format
  uint8_t* q8_ = nullptr;
  float* s8_ = nullptr;
  std::vector<const uint8_t*> q8p_;
  std::vector<const float*> s8p_;
  DevParams dparams() const;
  void* params_ = nullptr;
  float* grads_ = nullptr;
  std::vector<const void*> pp_;
  std::vector<float*> gp_;
  // [id] 1: its gradient (gsize_[id] elements at gp_[id]) is fresh. Mutable: DevParams hands the flags to the
  // layers, which clear them as they write.
  mutable std::vector<uint8_t> fresh_;
  std::vector<int64_t> gsize_;
  double* sq_sum_ = nullptr;  // take_grad_squares' slots (not owned)
  int32_t* sq_bad_ = nullptr;
  mutable std::vector<const float*> sq_at_;
  void settle(size_t id);  // gradient id zeroed if still fresh
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<Infer> infer_;
  int64_t count_ = 0;
  bool kept_ = false, aux_on_ = false, recompute_ = false;
  bool loss_in_bwd_ = false, head_deferred_ = false;  // set_loss_in_backward; the kept forward left the head
};

}  // namespace q3vl
