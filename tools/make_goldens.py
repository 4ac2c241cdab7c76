#!/usr/bin/env python3
"""Golden files for q3vl's parity tests against Hugging Face transformers.

How to run (on a machine with PyTorch and transformers 5.x, h5py, safetensors; no network needed):

    python tools/make_goldens.py OUTDIR [--device cpu|cuda] [--cases dense_tied,dense_untied,moe]

The results are committed under tests/data/golden/ (copy OUTDIR/<case>/ there). Everything is fp32 with eager
attention and fixed seeds; CPU is the default device because it has no TF32 and is deterministic.

Per case it writes
    OUTDIR/<case>/model/          save_pretrained output (config.json + model.safetensors), random weights
    OUTDIR/<case>/batch.h5        input_ids, attention_mask, labels, mm_token_type_ids (int64 [B,S]),
                                  pixel_values (f32 [Np,1536]), image_grid_thw (int64 [Nimg,3]); attrs: padding_side
    OUTDIR/<case>/expected.h5     logits (f32 [B,S,V]), loss (f64, = ce_loss + coef*aux_loss for MoE),
                                  ce_loss (f64, recomputed here in fp64 from the logits), aux_loss (f64, MoE),
                                  grads/<saved tensor name> (f32, same shape as the tensor in model.safetensors),
                                  position_ids (as the text model received them), hidden_states/<i>, vision/<...>
and OUTDIR/make_goldens.log with everything printed. A case that fails prints its traceback and the next one runs.

Batch: B=2, RIGHT padding (training layout; attention_mask 0 on the right). Sample 0 holds two images of grids
(1,4,6) and (1,6,4) (6 merged tokens each) inside text, each wrapped in <vision_start>/<vision_end>; sample 1 is
text only. Labels are -100 on prompt, vision and pad positions.
"""
import argparse
import inspect
import json
import os
import re
import sys
import traceback

LOG = None


def log(*args):
    msg = " ".join(str(a) for a in args)
    print(msg, flush=True)
    if LOG:
        LOG.write(msg + "\n")
        LOG.flush()


# Small vocabulary with the special tokens moved inside it.
VOCAB = 256
IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID, EOS_ID, PAD_ID = 250, 251, 252, 253, 254, 255
MROPE = [4, 2, 2]  # sums to head_dim/2 = 8
GRIDS = [(1, 4, 6), (1, 6, 4)]

CASES = {
    "dense_tied": dict(moe=False, tie=True, seed=1,
                       vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                   deepstack_visual_indexes=[0, 1], num_position_embeddings=256),
                       text=dict(num_hidden_layers=2, intermediate_size=128)),
    "dense_untied": dict(moe=False, tie=False, seed=2,
                         vision=dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=4,
                                     deepstack_visual_indexes=[0, 2], num_position_embeddings=2304),
                         text=dict(num_hidden_layers=3, intermediate_size=96)),
    "moe": dict(moe=True, tie=False, seed=3,
                vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                            deepstack_visual_indexes=[1], num_position_embeddings=256),
                text=dict(num_hidden_layers=2, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=0.01, norm_topk_prob=True)),
}


def config_dicts(case):
    vision = dict(hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, initializer_range=0.02)
    vision.update(case["vision"])
    text = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, attention_bias=False,
                attention_dropout=0.0, tie_word_embeddings=case["tie"], use_cache=False,
                pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=None)
    text.update(case["text"])
    top = dict(image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VSTART_ID,
               vision_end_token_id=VEND_ID, tie_word_embeddings=case["tie"])
    return vision, text, top


def build_config(case):
    import transformers
    if case["moe"]:
        cls = transformers.Qwen3VLMoeConfig
    else:
        cls = transformers.Qwen3VLConfig
    vision, text, top = config_dicts(case)
    rope_v5 = dict(rope_type="default", rope_theta=5000000.0, mrope_section=list(MROPE), mrope_interleaved=True)
    rope_v4 = dict(rope_theta=5000000.0,
                   rope_scaling=dict(rope_type="default", mrope_section=list(MROPE), mrope_interleaved=True))
    # Fallbacks drop every optional key: whatever the constructor refuses is set (or reported) one by one below.
    essential = {k: v for k, v in text.items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    attempts = [
        ("v5 rope_parameters", dict(text, rope_parameters=rope_v5)),
        ("v4 rope_theta+rope_scaling", dict(text, **rope_v4)),
        ("v5 rope_parameters, essential keys only", dict(essential, rope_parameters=rope_v5)),
        ("v4 rope, essential keys only", dict(essential, **rope_v4)),
    ]
    errors = []
    for what, t in attempts:
        try:
            cfg = cls(text_config=dict(t), vision_config=dict(vision), **top)
            log(f"  config built with {what}")
            break
        except Exception as e:  # noqa: BLE001 - try the other schema
            errors.append(f"{what}: {e!r}")
    else:
        raise RuntimeError("could not build the config: " + " | ".join(errors))

    tc, vc = cfg.text_config, cfg.vision_config
    # Force every value we rely on, whatever the constructor did with it, then check.
    for k, v in text.items():
        if k == "num_experts":
            for name in ("num_experts", "num_local_experts"):
                try:
                    setattr(tc, name, v)
                except Exception:  # noqa: BLE001
                    pass
            continue
        try:
            if getattr(tc, k, None) != v:
                setattr(tc, k, v)
        except Exception as e:  # noqa: BLE001
            log(f"  note: cannot set text_config.{k}: {e!r}")
    for k, v in vision.items():
        if getattr(vc, k, None) != v:
            setattr(vc, k, v)
    for k, v in top.items():
        if getattr(cfg, k, None) != v:
            setattr(cfg, k, v)
    rp = getattr(tc, "rope_parameters", None)
    rs = getattr(tc, "rope_scaling", None)
    log(f"  text_config.rope_parameters={rp} rope_scaling={rs}")
    sections = []
    for d in (rp, rs):
        if isinstance(d, dict):
            sections.append(d.get("mrope_section"))
            for sub in d.values():
                if isinstance(sub, dict):
                    sections.append(sub.get("mrope_section"))
    if list(MROPE) not in [list(s) if s is not None else None for s in sections]:
        # M-RoPE is only used when mrope_section is present; put it where this version looks.
        if isinstance(rp, dict):
            rp["mrope_section"] = list(MROPE)
            rp.setdefault("rope_theta", 5000000.0)
        else:
            tc.rope_parameters = dict(rope_v5)
        log(f"  forced mrope_section; rope_parameters now {getattr(tc, 'rope_parameters', None)}")
    if case["moe"]:
        ne = getattr(tc, "num_experts", None) or getattr(tc, "num_local_experts", None)
        assert ne == text["num_experts"], f"num_experts is {ne}"
    try:
        cfg._attn_implementation = "eager"
    except Exception as e:  # noqa: BLE001
        log(f"  note: cannot set config._attn_implementation: {e!r}")
    return cfg


def build_model(case, cfg):
    import torch
    import transformers
    cls = transformers.Qwen3VLMoeForConditionalGeneration if case["moe"] else transformers.Qwen3VLForConditionalGeneration
    torch.manual_seed(case["seed"])
    model = None
    for kwargs in (dict(attn_implementation="eager"), {}):
        try:
            model = cls._from_config(cfg, **kwargs)
            break
        except Exception as e:  # noqa: BLE001
            log(f"  note: _from_config({kwargs}) failed: {e!r}")
    if model is None:
        model = cls(cfg)
    model = model.to(torch.float32)
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("eager")
        except Exception as e:  # noqa: BLE001
            log(f"  note: set_attn_implementation failed: {e!r}")
    impls = {getattr(m.config, "_attn_implementation", None) for m in model.modules() if hasattr(m, "config")}
    log(f"  attention implementations in use: {impls}")

    # Tie or untie explicitly, so the case is what its name says.
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head.weight is emb.weight
    if case["tie"] and not tied:
        head.weight = emb.weight
        log("  tied lm_head to embed_tokens by hand")
    elif not case["tie"] and tied:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone())
        log("  untied lm_head by hand")
    return model


def randomize(model, seed):
    """Weights larger than the default init (std 0.02) so that activations and gradients are O(1)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if p.ndim == 1 and "norm" in name and name.endswith("weight"):
                v = 1.0 + 0.2 * torch.randn(shape, generator=g)
            elif p.ndim == 1:
                v = 0.1 * torch.randn(shape, generator=g)
            else:
                if p.ndim == 2:
                    fan_in = shape[-1]
                elif p.ndim == 3:  # fused experts: either layout, the smaller inner dim is close enough
                    fan_in = min(shape[1], shape[2])
                else:  # conv: [out, C, T, P, P]
                    fan_in = 1
                    for d in shape[1:]:
                        fan_in *= d
                v = torch.randn(shape, generator=g) / float(fan_in) ** 0.5
            p.copy_(v.to(p.dtype))


def make_batch(seed):
    import torch
    g = torch.Generator().manual_seed(1000 + seed)

    def text(n):
        return torch.randint(0, 240, (n,), generator=g).tolist()

    m = 2  # spatial merge
    s0, l0 = [], []
    prompt = text(3)
    s0 += prompt
    for i, (t, h, w) in enumerate(GRIDS):
        n = t * h * w // (m * m)
        s0 += [VSTART_ID] + [IMAGE_ID] * n + [VEND_ID]
        s0 += text(2) if i == 0 else []
    answer = text(6) + [EOS_ID]
    l0 = [-100] * len(s0) + answer
    s0 += answer
    s1 = text(8)
    answer1 = text(11) + [EOS_ID]
    l1 = [-100] * len(s1) + answer1
    s1 += answer1
    S = max(len(s0), len(s1))
    ids = torch.full((2, S), PAD_ID, dtype=torch.long)
    mask = torch.zeros((2, S), dtype=torch.long)
    labels = torch.full((2, S), -100, dtype=torch.long)
    for b, (s, l) in enumerate(((s0, l0), (s1, l1))):  # right padding
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
        labels[b, : len(l)] = torch.tensor(l)
    mm = (ids == IMAGE_ID).long()  # 1 at image-pad positions (2 would be video)
    n_patches = sum(t * h * w for t, h, w in GRIDS)
    pixel_values = torch.randn((n_patches, 3 * 2 * 16 * 16), generator=g, dtype=torch.float32)
    grid = torch.tensor(GRIDS, dtype=torch.long)
    return dict(input_ids=ids, attention_mask=mask, labels=labels, mm_token_type_ids=mm,
                pixel_values=pixel_values, image_grid_thw=grid)


def flatten_tensors(prefix, obj, out):
    """Collects the tensors inside a module output (tensor, tuple/list, ModelOutput/dict) by position/key."""
    import torch
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().float().cpu().numpy()
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            flatten_tensors(f"{prefix}/{i}", x, out)
    elif isinstance(obj, dict) or hasattr(obj, "items"):
        try:
            for k, x in obj.items():
                flatten_tensors(f"{prefix}/{k}", x, out)
        except Exception:  # noqa: BLE001
            pass


def find_module(model, paths):
    for path in paths:
        m = model
        try:
            for part in path.split("."):
                m = getattr(m, part)
            return m
        except AttributeError:
            continue
    return None


def aux_reference(router_logits, attention_mask, num_experts, top_k, softmaxes):
    """Load-balancing loss of spec 5.3 (pooled over layers, mask-weighted), in fp64, for the log only.
    softmaxes = how many times softmax is applied to the router outputs (2 reproduces issue #45120)."""
    import torch
    P = torch.cat([r.detach().double().reshape(-1, num_experts) for r in router_logits], 0)
    for _ in range(softmaxes):
        P = torch.softmax(P, -1)
    sel = torch.topk(P, top_k, -1).indices
    onehot = torch.nn.functional.one_hot(sel, num_experts).double().sum(1)  # [N, E], rows sum to k
    w = attention_mask.reshape(-1).double().repeat(len(router_logits))[:, None]
    f = (onehot * w).sum(0) / w.sum()
    p = (P * w).sum(0) / w.sum()
    return float(num_experts * (f * p).sum())


def run_case(name, case, outdir):
    import h5py
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file

    log(f"=== case {name} ===")
    log(f"  case: {json.dumps(case)}")
    cdir = os.path.join(outdir, name)
    os.makedirs(cdir, exist_ok=True)
    cfg = build_config(case)
    model = build_model(case, cfg)
    randomize(model, case["seed"])
    model.train()  # dropout is 0 everywhere; train() selects the training code paths (MoE)
    device = torch.device(ARGS.device)
    model.to(device)

    # Structural checks: fail the case rather than write goldens of the wrong model.
    pnames = dict(model.named_parameters())

    def count(pattern):
        return len({m.group(1) for k in pnames for m in [re.search(pattern, k)] if m})
    n_blocks = count(r"visual\.blocks\.(\d+)\.")
    n_layers = count(r"layers\.(\d+)\.")
    n_ds = count(r"deepstack_merger_list\.(\d+)\.")
    assert n_blocks == case["vision"]["depth"], f"vision blocks {n_blocks}"
    assert n_layers == case["text"]["num_hidden_layers"], f"decoder layers {n_layers}"
    assert n_ds == len(case["vision"]["deepstack_visual_indexes"]), f"deepstack mergers {n_ds}"
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == case["tie"], f"tied={tied}"
    log(f"  params: {sum(p.numel() for p in model.parameters())} (unique), tied={tied}")

    # Save first, so that the saved weights are exactly the ones the forward pass uses.
    mdir = os.path.join(cdir, "model")
    model.save_pretrained(mdir)  # safetensors is the default in 4.x and the only format in 5.x
    saved = {}
    for fn in sorted(os.listdir(mdir)):
        if fn.endswith(".safetensors"):
            saved.update(load_file(os.path.join(mdir, fn)))
    with open(os.path.join(mdir, "config.json")) as f:
        saved_cfg = json.load(f)
    log(f"  saved config.json: transformers_version={saved_cfg.get('transformers_version')} "
        f"tie(top)={saved_cfg.get('tie_word_embeddings')} "
        f"tie(text)={saved_cfg.get('text_config', {}).get('tie_word_embeddings')}")
    log(f"  saved tensors ({len(saved)}):")
    for k in sorted(saved):
        log(f"    {k} {list(saved[k].shape)} {saved[k].dtype}")

    batch = make_batch(case["seed"])
    with h5py.File(os.path.join(cdir, "batch.h5"), "w", libver=("earliest", "v110")) as f:
        for k, v in batch.items():
            f.create_dataset(k, data=v.numpy())
        f.attrs["padding_side"] = "right"
        f.attrs["seed"] = case["seed"]
        f.attrs["case"] = json.dumps(case)
        f.attrs["description"] = ("sample 0: text + 2 images (grids (1,4,6), (1,6,4)); sample 1: text only; "
                                  "labels -100 on prompt/vision/pad")

    # Capture what the text model and the vision tower see/produce.
    captured = {}
    hooks = []
    lm = find_module(model, ["model.language_model", "language_model"])
    if lm is not None:
        def pre_hook(mod, args, kwargs):
            pid = kwargs.get("position_ids")
            if pid is not None:
                captured["position_ids"] = pid.detach().cpu().numpy()
        try:
            hooks.append(lm.register_forward_pre_hook(pre_hook, with_kwargs=True))
        except Exception as e:  # noqa: BLE001
            log(f"  note: no position_ids hook: {e!r}")
    vis = find_module(model, ["model.visual", "visual"])
    if vis is not None:
        def vis_hook(mod, args, out):
            flatten_tensors("vision", out, captured)
        hooks.append(vis.register_forward_hook(vis_hook))

    # The reference expert loop, not a grouped-GEMM kernel, where this version lets us choose.
    if case["moe"] and hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
            log("  experts implementation: eager")
        except Exception as e:  # noqa: BLE001
            log(f"  note: set_experts_implementation failed: {e!r}")

    inputs = {k: v.to(device) for k, v in batch.items()}
    kwargs = dict(inputs, use_cache=False, output_hidden_states=True, return_dict=True)
    if case["moe"]:
        kwargs["output_router_logits"] = True
    try:
        out = model(**kwargs)
    except Exception as e:  # noqa: BLE001 - one retry with the plainest call
        log(f"  note: forward failed ({e!r}); retrying without output_hidden_states/return_dict/use_cache")
        for k in ("output_hidden_states", "return_dict", "use_cache"):
            kwargs.pop(k)
        captured.clear()
        out = model(**kwargs)
    for h in hooks:
        h.remove()

    logits = out.logits
    loss = out.loss
    # Independent fp64 cross-entropy of spec 5.1 from the same logits.
    V = logits.shape[-1]
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].to(device)
    ce = torch.nn.functional.cross_entropy(logits.detach().double().reshape(-1, V), shift.reshape(-1),
                                           ignore_index=-100, reduction="mean")
    log(f"  loss={loss.item():.8f}  ce(fp64, recomputed)={ce.item():.8f}")
    aux = getattr(out, "aux_loss", None)
    coef = getattr(model.config.text_config, "router_aux_loss_coef", None)
    if coef is None:
        coef = case["text"].get("router_aux_loss_coef", 0.0)
    router_kind = ""
    if case["moe"]:
        if aux is None:
            raise RuntimeError("MoE forward returned no aux_loss although output_router_logits=True")
        log(f"  aux_loss={aux.item():.8f} coef={coef} ce+coef*aux={ce.item() + coef * aux.item():.8f}")
        rl = getattr(out, "router_logits", None)
        if rl is not None:
            rows = rl[0].detach().float()
            is_prob = bool((rows >= 0).all() and torch.allclose(rows.sum(-1), torch.ones_like(rows.sum(-1)), atol=1e-4))
            router_kind = "probabilities" if is_prob else "logits"
            try:
                k = case["text"]["num_experts_per_tok"]
                E = case["text"]["num_experts"]
                mask = batch["attention_mask"].to(device)
                n0 = 0 if is_prob else 1
                refs = {f"{n0 + i} softmax(es) of the raw logits": aux_reference(rl, mask, E, k, i) for i in (1, 2)}
                log(f"  router outputs are {router_kind}; spec 5.3 reference aux: {refs} (model: {aux.item():.8f})")
            except Exception as e:  # noqa: BLE001
                log(f"  note: aux reference failed: {e!r}")
        if abs(loss.item() - (ce.item() + coef * aux.item())) > 1e-5 * max(1.0, abs(loss.item())):
            log("  WARNING: loss != ce + coef*aux; the stored loss is the model's, ce_loss and aux_loss are separate")

    model.zero_grad(set_to_none=True)
    loss.backward()

    # Gradients in the layout of the saved tensors: match each saved tensor to a parameter by name and value.
    params = dict(model.named_parameters(remove_duplicate=False))
    grads = {}
    layouts = {}
    for key, t in saved.items():
        p = params.get(key)
        if p is None:
            cands = [n for n in params if n.endswith(key) or key.endswith(n)]
            p = params[cands[0]] if len(cands) == 1 else None
        if p is None:
            log(f"  WARNING: saved tensor {key} matches no parameter; no grad written")
            continue
        if p.grad is None:
            log(f"  WARNING: parameter for {key} has no grad (unused?); writing zeros")
            gr = torch.zeros_like(p)
        else:
            gr = p.grad
        pv = p.detach().cpu()
        if tuple(pv.shape) == tuple(t.shape) and torch.equal(pv, t):
            grads[key] = gr.detach().cpu()
            layouts[key] = "same"
        elif pv.ndim >= 2 and tuple(pv.transpose(-1, -2).shape) == tuple(t.shape) and \
                torch.equal(pv.transpose(-1, -2).contiguous(), t):
            grads[key] = gr.detach().cpu().transpose(-1, -2).contiguous()
            layouts[key] = "transposed(-1,-2)"
        else:
            log(f"  WARNING: saved {key} {list(t.shape)} does not equal its parameter {list(pv.shape)}; no grad")
    for n, p in model.named_parameters():
        if n not in saved and not any(v is p for k, v in params.items() if k in saved):
            log(f"  WARNING: parameter {n} {list(p.shape)} is not in the saved files")
    transposed = sorted(k for k, v in layouts.items() if v != "same")
    log(f"  grads written: {len(grads)}; stored transposed relative to the module: {transposed}")

    with h5py.File(os.path.join(cdir, "expected.h5"), "w", libver=("earliest", "v110")) as f:
        f.create_dataset("logits", data=logits.detach().float().cpu().numpy())
        f.create_dataset("loss", data=np.float64(loss.item()))
        f.create_dataset("ce_loss", data=np.float64(ce.item()))
        if aux is not None:
            f.create_dataset("aux_loss", data=np.float64(aux.item()))
            f.attrs["router_aux_loss_coef"] = float(coef)
            f.attrs["router_outputs"] = router_kind
        for k, g in grads.items():
            f.create_dataset("grads/" + k, data=g.float().numpy())
        hs = getattr(out, "hidden_states", None)
        if hs is not None:
            for i, h in enumerate(hs):
                f.create_dataset(f"hidden_states/{i}", data=h.detach().float().cpu().numpy())
        for k, v in captured.items():
            f.create_dataset(k, data=v)
        f.attrs["torch_version"] = str(torch.__version__)
        f.attrs["transformers_version"] = str(transformers.__version__)
        f.attrs["tied_embeddings"] = bool(tied)
        f.attrs["padding_side"] = "right"
        f.attrs["device"] = str(device)
        f.attrs["layouts_transposed"] = json.dumps(transposed)
    log(f"  position_ids shape: {None if 'position_ids' not in captured else captured['position_ids'].shape}")
    log(f"  vision outputs: {[(k, v.shape) for k, v in captured.items() if k.startswith('vision')]}")
    log(f"  wrote {cdir}")


def main():
    global LOG, ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default=",".join(CASES))
    ARGS = ap.parse_args()
    os.makedirs(ARGS.outdir, exist_ok=True)
    LOG = open(os.path.join(ARGS.outdir, "make_goldens.log"), "w")
    try:
        import torch
        import transformers
        log(f"python {sys.version.split()[0]} torch {torch.__version__} transformers {transformers.__version__}")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
        return 1
    failed = []
    for name in ARGS.cases.split(","):
        try:
            run_case(name, CASES[name], ARGS.outdir)
        except Exception:  # noqa: BLE001 - keep going, report at the end
            log(f"  CASE {name} FAILED:\n{traceback.format_exc()}")
            failed.append(name)
    log(f"done; failed cases: {failed or 'none'}")
    LOG.close()
    return 1 if failed else 0


ARGS = None
if __name__ == "__main__":
    sys.exit(main())
