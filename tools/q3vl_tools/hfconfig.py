"""Qwen3-VL config.json and weight layouts (spec sections 7, 8 and 11).

Exports use the schema of the released checkpoints (transformers 4.57: text_config.rope_theta +
rope_scaling, num_experts; transformers_version "4.57.0") and therefore the released MoE expert layout
gate_up_proj [E,H,2Im], down_proj [E,Im,H]. q3vl checkpoints hold the compute layout [E,2Im,H]/[E,H,Im],
which is also what transformers 5 writes (config transformers_version >= 5)."""
import copy
import re

from . import ToolError

EXPORT_VERSION = "4.57.0"


def version_major(cfg):
    m = re.match(r"\d+", str(cfg.get("transformers_version", "")))
    return int(m.group()) if m else 0


def is_expert(name):
    return name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj")


def swap_expert_shape(name, shape):
    """The shape in the other layout (the transpose of dims 1 and 2 is its own inverse)."""
    return [shape[0], shape[2], shape[1]] if is_expert(name) else list(shape)


def to_compute_layout(cfg, name, a):
    """A tensor as stored under config `cfg` -> q3vl's compute layout (experts transposed if released)."""
    if is_expert(name) and version_major(cfg) < 5:
        return a.transpose(0, 2, 1).copy()
    return a


def to_released_layout(name, a):
    """A tensor in the compute layout -> the released on-disk layout."""
    return a.transpose(0, 2, 1).copy() if is_expert(name) else a


def released_config(src, dtype):
    """Any Qwen3-VL config.json (4.57 or 5.x schema) -> the 4.57 schema, keeping every other key."""
    c = copy.deepcopy(src)
    if c.get("model_type") not in ("qwen3_vl", "qwen3_vl_moe"):
        raise ToolError(f"config.json: model_type {c.get('model_type')!r} is not qwen3_vl or qwen3_vl_moe")
    moe = c["model_type"] == "qwen3_vl_moe"
    t, v = c.setdefault("text_config", {}), c.setdefault("vision_config", {})
    rp = t.pop("rope_parameters", None) or c.pop("rope_parameters", None)
    if rp is not None:
        if "rope_theta" not in rp and len(rp) == 1:  # keyed by layer type
            rp = next(iter(rp.values()))
        t["rope_theta"] = rp["rope_theta"]
        t["rope_scaling"] = {"mrope_interleaved": rp.get("mrope_interleaved", True),
                             "mrope_section": rp["mrope_section"], "rope_type": rp.get("rope_type", "default")}
    if "num_local_experts" in t:
        t["num_experts"] = t.pop("num_local_experts")
    v.pop("rope_parameters", None)
    v["model_type"] = c["model_type"]
    t["model_type"] = "qwen3_vl_moe_text" if moe else "qwen3_vl_text"
    c.pop("torch_dtype", None)
    t.pop("torch_dtype", None)
    c["dtype"] = t["dtype"] = dtype
    c["transformers_version"] = EXPORT_VERSION
    c["text_config"], c["vision_config"] = dict(sorted(t.items())), dict(sorted(v.items()))
    return dict(sorted(c.items()))


def expected_shapes(cfg):
    """{hf name: shape in the compute layout} of every weight the model has (params.cpp's table)."""
    t, v = cfg["text_config"], cfg["vision_config"]
    dv, iv, dout, m = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v.get("spatial_merge_size", 2)
    dm = dv * m * m
    s = {"model.visual.patch_embed.proj.weight": [dv, v.get("in_channels", 3), v.get("temporal_patch_size", 2),
                                                  v.get("patch_size", 16), v.get("patch_size", 16)],
         "model.visual.patch_embed.proj.bias": [dv],
         "model.visual.pos_embed.weight": [v.get("num_position_embeddings", 2304), dv]}
    for i in range(v["depth"]):
        b = f"model.visual.blocks.{i}."
        s.update({b + "norm1.weight": [dv], b + "norm1.bias": [dv], b + "norm2.weight": [dv], b + "norm2.bias": [dv],
                  b + "attn.qkv.weight": [3 * dv, dv], b + "attn.qkv.bias": [3 * dv],
                  b + "attn.proj.weight": [dv, dv], b + "attn.proj.bias": [dv],
                  b + "mlp.linear_fc1.weight": [iv, dv], b + "mlp.linear_fc1.bias": [iv],
                  b + "mlp.linear_fc2.weight": [dv, iv], b + "mlp.linear_fc2.bias": [dv]})
    mergers = [("model.visual.merger.", dv)] + [(f"model.visual.deepstack_merger_list.{j}.", dm)
                                                 for j in range(len(v["deepstack_visual_indexes"]))]
    for b, norm in mergers:
        s.update({b + "norm.weight": [norm], b + "norm.bias": [norm], b + "linear_fc1.weight": [dm, dm],
                  b + "linear_fc1.bias": [dm], b + "linear_fc2.weight": [dout, dm], b + "linear_fc2.bias": [dout]})
    h, hd, vocab = t["hidden_size"], t["head_dim"], t["vocab_size"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    moe = cfg["model_type"] == "qwen3_vl_moe"
    e = t.get("num_experts", t.get("num_local_experts"))
    step, only = t.get("decoder_sparse_step", 1), t.get("mlp_only_layers") or []
    s["model.language_model.embed_tokens.weight"] = [vocab, h]
    for l in range(t["num_hidden_layers"]):
        b = f"model.language_model.layers.{l}."
        s.update({b + "input_layernorm.weight": [h], b + "post_attention_layernorm.weight": [h],
                  b + "self_attn.q_proj.weight": [nh * hd, h], b + "self_attn.k_proj.weight": [nkv * hd, h],
                  b + "self_attn.v_proj.weight": [nkv * hd, h], b + "self_attn.o_proj.weight": [h, nh * hd],
                  b + "self_attn.q_norm.weight": [hd], b + "self_attn.k_norm.weight": [hd]})
        if moe and l not in only and (l + 1) % step == 0:
            im = t["moe_intermediate_size"]
            s.update({b + "mlp.gate.weight": [e, h], b + "mlp.experts.gate_up_proj": [e, 2 * im, h],
                      b + "mlp.experts.down_proj": [e, h, im]})
        else:
            i = t["intermediate_size"]
            s.update({b + "mlp.gate_proj.weight": [i, h], b + "mlp.up_proj.weight": [i, h],
                      b + "mlp.down_proj.weight": [h, i]})
    s["model.language_model.norm.weight"] = [h]
    if not cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False)):
        s["lm_head.weight"] = [vocab, h]
    return s
