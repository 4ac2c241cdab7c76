// The test reference: the host model of Qwen3-VL (dense and MoE) on the ops:: templates, assembled from the layers:
// vision tower + mergers, fusion into the text embeddings, decoder with DeepStack injection, final norm, LM head and
// loss; hand-written backward in reverse order.
// Instantiated for float and double (whole-model finite-difference gradient checks). Compiled into the test binaries
// only; the product's model is DevModel (q3vl/model/dev_model.hpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "layers.hpp"
#include "q3vl/model/batch.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/model/hooks.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/model/weights.hpp"

namespace q3vl {


template <class T>
class BasicModel {
 public:
  // with_storage=false: no full params/grads are ever allocated (ZeRO-3, whose engine binds each unit to a
  // gathered buffer only while it is used); params() and grads() are null and every unit points nowhere.
  // ep: this rank's share of the MoE experts (expert parallelism; the table holds only those), see set_experts.
  explicit BasicModel(const ModelConfig& cfg, bool with_storage = true, ExpertSplit ep = {});

  const ModelConfig& config() const { return cfg_; }
  ParamTable& table() { return table_; }
  const ParamTable& table() const { return table_; }
  // Default storage: all units concatenated (unit u at table().units()[u].offset).
  T* params() { return store_p_.data(); }
  T* grads() { return store_g_.data(); }
  T* param(int id) { return pp_[id]; }
  T* grad(int id) { return gp_[id]; }
  // Point one ZeRO unit at external flat buffers (same layout as the table's unit); grads may be null only if the
  // unit is never differentiated.
  void bind_unit(int unit, T* params, T* grads);
  // Frees the default storage (params() and grads() become null; every unit points nowhere until bound): ZeRO-3
  // binds each unit to a gathered buffer through the hooks only while it is used.
  void release_storage();
  // Called around every unit use by forward and backward (prefill/decode too); null: none.
  void set_hooks(UnitHooks* h) { hooks_ = h; }
  // Expert parallelism: the exchange that moves MoE rows to the ranks owning their experts (its group is the
  // table's ExpertSplit). Null: every expert is local. Generation and eval need every expert local.
  void set_experts(ExpertExchange* ex);
  // A micro-step without tokens on this rank still serves the other ranks' tokens routed to its experts: the same
  // exchanges in the same order as forward (backward) of a batch, with no rows of its own. Nothing without
  // an exchange.
  void idle_pass(bool backward);
  // The units' before_forward (backward: before_backward) calls of one pass over a batch with images, in order;
  // any pass calls a subsequence of it (no images: no vision units). The same on every rank.
  std::vector<int> unit_order(bool backward) const;
  void zero_grads();
  // Only these parameters get gradients (the others' grad pointers stay null even in a bound unit: a frozen LoRA
  // base computes no weight gradient at all). Empty: all.
  void set_trainable(const std::vector<bool>& trainable) {
    trainable_ = trainable;
    rebind();
  }
  // The adapters' run-time settings (lora.dropout's seed and per-micro-step nonce, training or not).
  LoraRun& lora() { return lora_; }
  // Norm weights 1, biases 0, everything else N(0, std^2) (tests and demos); the values of init_param_range.
  void init_random(uint64_t seed, double std = 0.02);

  // Returns the loss: mean CE over supervised targets (0 when there are none) + coef*aux when aux_loss.
  // logits_out gets [B,S,V] (packed: [N,V]); aux_out gets the load-balancing loss (MoE; 0 for dense).
  double forward(const Batch& b, bool keep_for_backward, std::vector<T>* logits_out = nullptr,
                 double* aux_out = nullptr, bool aux_loss = false);
  double forward(const PackedBatch& b, bool keep_for_backward, std::vector<T>* logits_out = nullptr,
                 double* aux_out = nullptr, bool aux_loss = false);
  // Accumulates dL/dparam of the last forward(keep_for_backward=true) into grads.
  void backward();

  // Activation recomputation per block (train.recompute = "block"): a kept forward stores only each decoder
  // layer's and ViT block's input; backward reruns that block's forward (same code, same inputs: bitwise the same
  // activations) just before its backward, while ZeRO-3 holds the unit for the backward anyway.
  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }
  // Bytes of activations the last kept forward holds for backward (block contexts, not the final-norm/head rows).
  int64_t activation_bytes() const;
  // Highest activation_bytes() seen since the last reset (sampled after each forward and each recomputed block).
  int64_t activation_peak() const { return act_peak_; }
  void reset_activation_peak() { act_peak_ = 0; }

  int64_t supervised_tokens() const { return count_; }

  // Generation (no backward). prefill starts a fresh cache for one sequence per prompt (images in prompt order in
  // pixels/grid): vision tower once, decoder with DeepStack, keys and values cached. Returns the logits of each
  // prompt's last position [B, V]; the LM head runs on those rows only.
  std::vector<T> prefill(const std::vector<std::vector<int64_t>>& prompts, const std::vector<float>& pixels,
                         const std::vector<int64_t>& grid, HostKvCache<T>& cache);
  // Appends tokens[i] to cached sequence seqs[i] (text tokens only) and returns their next-token logits [n, V].
  std::vector<T> decode(const std::vector<int>& seqs, const std::vector<int64_t>& tokens, HostKvCache<T>& cache);
  // Continuous batching (serve): prompt chunks and generated tokens of several sequences in one pass, each segment
  // extending its own cache sequence (added by the caller with cache.add()). Returns each segment's last-row
  // logits [segs, V]. Blocks are reserved as needed; a full pool is an error (the caller reserves ahead).
  std::vector<T> step(const std::vector<StepSegment<T>>& segs, HostKvCache<T>& cache);
  // Tensor-parallel inference: this model holds one rank's slice of every decoder layer (serve/tp.hpp shards it);
  // reduce sums the partial attention and MLP outputs over the group, and the LM head computes only vocabulary rows
  // [v0, v1), so prefill/decode/step return [rows, v1 - v0] logits.
  void set_tensor_parallel(PartialSum<T> reduce, int64_t v0, int64_t v1) {
    tp_reduce_ = std::move(reduce), head_v0_ = v0, head_v1_ = v1;
  }
  // Low-precision weights for inference (generate and serve with model.weight_dtype = "int8", "fp8", "bf16", "fp16"):
  // every linear of the text decoder (q/k/v/o_proj, the MLP's gate/up/down_proj or the MoE experts) and the LM head
  // (low_params) are stored in dt and their fp32 copies are freed with every gradient, once, after loading (and
  // after tensor-parallel sharding: int8's scales are those of the rows a rank holds). int8, fp8: one fp32 scale per
  // output channel (ops::quantize_rows); bf16/fp16: rounded to nearest even, no scale (a weight beyond fp16's
  // range is refused by name). The products widen tiles of rows to fp32 (ops::linear_lowp_fwd): the CPU computes in
  // fp32, the point is the memory. Tied token embeddings are the head's rows (a row is a token: a lookup widens it,
  // by its own scale for int8 and fp8). Stays fp32: untied token embeddings (read one row per token, never multiplied
  // through; in int8 they raised the MoE golden model's logits error from 1.8% to 7.2%, docs/PERFORMANCE.md), the
  // norms (one value per channel: nothing to save), the MoE router (E x H, small, and its top-k choice flips on small
  // errors), the vision tower and mergers (run once per image, so compute-bound, not the per-token weight reads this
  // is for; their error would reach every image token and, through DeepStack, several decoder layers), and LoRA
  // adapters. After this the model is inference only: forward without keep_for_backward, prefill, decode, step.
  struct WeightBytes {
    int64_t fp32 = 0;    // every weight in fp32 (before)
    int64_t low = 0;     // the low-precision weights
    int64_t scales = 0;  // their fp32 scales (int8, fp8)
    int64_t kept = 0;    // the weights left in fp32
    int64_t now() const { return low + scales + kept; }
  };
  WeightBytes lower_weights(LowDtype dt);
  // Inference only (generate, serve): frees the gradient storage, as large as the weights.
  void drop_gradients();
  bool lowered() const { return !low_.empty(); }
  const LowWeight* low_param(int id) const { return lowered() && low_[size_t(id)].w ? &low_[size_t(id)] : nullptr; }

  // The vision tower and mergers alone, for one prompt's images (pixels/grid as prefill): features of its image
  // tokens img [n, H] and the DeepStack features ds [deepstack][n*H].
  void vision_features(const std::vector<float>& pixels, const std::vector<int64_t>& grid, std::vector<T>& img,
                       std::vector<std::vector<T>>& ds);

 private:
  using Stream = TokenStream;
  double run(Stream&& s, const std::vector<float>& pixels, const std::vector<int64_t>& grid, bool keep,
             std::vector<T>* logits_out, double* aux_out, bool aux_loss);
  // Vision tower and mergers: img [Np/4, H] and one DeepStack feature set per deepstack index.
  void encode_images(const std::vector<float>& pixels, const std::vector<int64_t>& grid, bool keep,
                     std::vector<T>& img, std::vector<std::vector<T>>& ds);
  // Token embeddings with the image features over the image tokens (their positions go to vis_).
  std::vector<T> embed(const std::vector<int64_t>& ids, const std::vector<T>& img);
  // Inference through the decoder for new tokens x [N, H] in segments cu (segment s extends cache sequence
  // seqs[s]); ds (may be empty) is added at vis_ after the first layers. Returns each segment's last-row logits.
  std::vector<T> extend(std::vector<T>& x, const std::vector<int64_t>& cu, const std::vector<int64_t>& pos3,
                        const std::vector<int>& seqs, const std::vector<std::vector<T>>& ds, HostKvCache<T>& cache);
  ParamView<T> view() const {
    return {pp_.data(), gp_.data(), cfg_.lora.on() ? &lora_ : nullptr, low_.empty() ? nullptr : low_.data()};
  }
  void need_fp32(const char* what) const;  // fails on a model holding low-precision weights
  void rebind();
  // Hook calls for the unit holding parameter `id`.
  void enter(int id, bool bwd);
  void leave(int id, bool bwd);
  // Decoder layer l's units: the layer's, then its experts' (MoE).
  void enter_layer(int l, bool bwd);
  void leave_layer(int l, bool bwd);
  void need_all_experts(const char* what) const;

  ModelConfig cfg_;
  ParamTable table_;
  std::vector<T> store_p_, store_g_;
  // lower_weights: the low-precision weights in parameter id order (bytes), the 8-bit formats' scales, views by id.
  std::vector<char> low_store_;
  std::vector<float> low_scales_;
  std::vector<LowWeight> low_;
  std::vector<T*> unit_p_, unit_g_, pp_, gp_;
  UnitHooks* hooks_ = nullptr;
  std::vector<bool> trainable_;
  LoraRun lora_;
  ExpertExchange* ex_ = nullptr;
  std::vector<MoeCtx<T>> idle_;  // idle_pass's owner-side contexts per layer

  // Saved by forward for backward.
  bool kept_ = false, aux_on_ = false, recompute_ = false;
  int64_t act_peak_ = 0;
  VisionBlockCtx<T> vscratch_;  // recompute: the one block whose full context exists
  DecoderCtx<T> dscratch_;
  Stream st_;
  std::vector<T> pixels_;
  std::vector<int64_t> grid_, vcu_, vis_;  // vision segments; token index of each visual position
  std::vector<T> vcos_, vsin_, tcos_, tsin_;
  std::vector<VisionBlockCtx<T>> vctx_;
  MergerCtx<T> mctx_;
  std::vector<MergerCtx<T>> dsctx_;
  std::vector<DecoderCtx<T>> dctx_;
  std::vector<T> xf_, hf_, rf_;            // input and output of the final norm, its rstd
  std::vector<T> probs_, aux_f_;           // pooled router probabilities [nmoe*N, E]
  std::vector<int64_t> idx_;               // pooled top-k [nmoe*N, k]
  std::vector<int> moe_slot_;              // decoder layer -> MoE slot (-1: dense)
  int64_t count_ = 0;
  PartialSum<T> tp_reduce_;
  int64_t head_v0_ = 0, head_v1_ = 0;  // LM-head rows computed (v1 = 0: all)
};

using Model = BasicModel<float>;

// The parameters BasicModel::lower_weights holds in low precision, by id (sizing without a model: planner, reports).
std::vector<bool> low_params(const ParamTable& t);

}  // namespace q3vl
