"""EAGLE-3 trained here: datagen stores the three feature layers, training-time test unrolls the drafter on its own
outputs exactly as it drafts, the draft vocabulary comes from the answers' token counts, a trained drafter is
lossless on every family (greedy == AR == HF generate; sampling by the chi-square test), and a trained head written
in the released SafeAILab layout by this file's own writer loads back with the same proposals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mmspec_ray.decoding.engine import AREngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.eagle3 import Eagle3Drafter, default_feature_layers, frequent_tokens
from mmspec_ray.targets import Request, wrap
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features
from mmspec_ray.training.methods import Eagle3Method, multi_step_forward
from mmspec_ray.training.trainer import TrainConfig, train_drafter
from families import FAMILIES, build_target
from test_engine import SAMPLED_FLOOR, check_greedy_lossless, check_learned, check_trained_drafter_samples
from tiny import random_images, tiny_llava


def features(target, reqs, path, n_tokens: int = 16):
    return load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=n_tokens, aux_features=True),
                                           path))


def image_requests(n: int, offset: int = 0) -> list[Request]:
    return [Request(prompt="describe the image", images=tuple(random_images(1, seed=offset + i))) for i in range(n)]


def test_datagen_stores_the_three_layers_the_drafter_reads():
    """On an 8-layer target: hs[2], hs[4], hs[5] (the input of those decoder layers), low-mid-high, in bfloat16."""
    target = wrap(*tiny_llava(init=0.3, layers=8))
    from mmspec_ray.training.datagen import featurize

    req = image_requests(1)[0]
    ex = featurize(target, req, [5, 6, 7], DatagenRecipe(aux_features=True, dtype="float32"))
    assert default_feature_layers(target.text_config.num_hidden_layers) == [2, 4, 5]
    inputs = target.encode(req)
    ids = torch.cat([inputs["input_ids"], torch.tensor([[5, 6, 7]])], 1)
    with torch.inference_mode():
        hs = target.model(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)},
                          output_hidden_states=True).hidden_states
    want = torch.cat([hs[k][0] for k in (2, 4, 5)], -1)
    assert ex.aux.dtype == torch.bfloat16 and ex.aux.shape == (ids.shape[1], 3 * target.hidden_size)
    torch.testing.assert_close(ex.aux.float(), want.bfloat16().float(), atol=1e-2, rtol=1e-2)
    assert not torch.allclose(hs[2][0], hs[4][0])  # the three layers differ: their order is checked
    assert target.feature_layers == ()  # featurize asked for them for its forward only


def test_training_time_test_equals_drafting_chains_step_by_step():
    """Unrolled step f's output at t equals a chain drafted after real features up to a = t - f: the context
    0..a read with the three layers' states (fused by fc), then f entries fed the previous draft output."""
    torch.manual_seed(0)
    target = wrap(*tiny_llava(init=0.3))
    head = Eagle3Drafter.random(target, seed=5, std=0.2).head.float()
    B, T, d = 2, 9, target.hidden_size
    emb, feat = torch.randn(B, T, d), torch.randn(B, T, 3 * d)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 7:] = False
    with torch.no_grad():
        outs = multi_step_forward(head, emb, feat, valid, 4, run=lambda e, f_, s, p, m, kv, at: head(e, f_, p, m, kv, at))
        for b in range(B):
            n = int(valid[b].sum())
            for a in range(n):
                ctx = torch.ones(1, 1, a + 1, a + 1, dtype=torch.bool).tril()
                kv = [torch.zeros(1, head.layer.kv_heads, a + 5, head.layer.head_dim) for _ in range(2)]
                g = head(emb[b:b + 1, :a + 1], feat[b:b + 1, :a + 1], torch.arange(a + 1)[None], ctx, kv, 0)[:, -1:]
                torch.testing.assert_close(outs[0][b, a], g[0, 0], atol=1e-5, rtol=1e-4)
                for j in range(1, 4):
                    t = a + j
                    if t >= n:
                        break
                    m = torch.ones(1, 1, 1, a + 1 + j, dtype=torch.bool)
                    g = head(emb[b:b + 1, t:t + 1], g, torch.tensor([[t]]), m, kv, a + j)
                    torch.testing.assert_close(outs[j][b, t], g[0, 0], atol=1e-5, rtol=1e-4)


def test_draft_vocabulary_is_the_most_frequent_answer_tokens():
    answers = [torch.tensor([7, 7, 7, 3, 3, 9]), torch.tensor([3, 12, 7])]
    assert frequent_tokens(answers, vocab=20, size=3) == [3, 7, 9]  # 7 x4, 3 x3, then 9 and 12 tie: lower id
    assert frequent_tokens(answers, vocab=20, size=6) == [0, 1, 3, 7, 9, 12]  # padded with the lowest unseen ids


def test_eagle3_trains_and_its_reduced_vocabulary_round_trips(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    feats = features(target, image_requests(12), tmp_path / "f")
    cfg = TrainConfig(epochs=6, batch_size=4, lr=3e-3, warmup_steps=2, eval_max_new_tokens=8)
    out = train_drafter(Eagle3Method(draft_vocab_size=64, ttt_steps=3), target, feats, tmp_path / "d", cfg,
                        heldout=image_requests(2, offset=100))
    hist = json.loads((out / "history.json").read_text())
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert {f"top1_step{i}" for i in range(3)} <= set(hist[-1])
    saved = json.loads((out / "config.json").read_text())
    assert saved["method"] == "eagle3" and saved["draft_vocab_size"] == 64 and len(saved["draft_tokens"]) == 64
    counted = frequent_tokens([ex.input_ids[ex.n_prompt:] for ex in feats], target.vocab_size, 64)
    assert saved["draft_tokens"] == counted
    d = load_drafter(str(out), target)
    assert isinstance(d, Eagle3Drafter) and d.head.lm_head.weight.shape[0] == 64
    assert sorted((torch.arange(64) + d.head.d2t).tolist()) == counted
    req = image_requests(1, offset=300)[0]
    with torch.inference_mode():
        pre = target.prefill(target.encode(req))
        d.begin(target, pre, int(pre.logits[0, -1].argmax()))
        tree = d.propose(int(pre.logits[0, -1].argmax()), TreeConfig(top_k=4, depth=3, total_tokens=12))
    assert set(tree.tokens[1:].tolist()) <= set(counted)  # drafts only from the draft vocabulary


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_eagle3_is_lossless_on_every_family_and_request(family, tmp_path):
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    feats = features(target, list(reqs.values()) * 2, tmp_path / "f", n_tokens=12)
    cfg = TrainConfig(epochs=12, batch_size=2, lr=3e-3, warmup_steps=1)
    out = train_drafter(Eagle3Method(ttt_steps=3), target, feats, tmp_path / "d", cfg)
    top1 = check_learned(out)
    d = load_drafter(str(out), target)
    accepted = check_greedy_lossless(target, reqs, lambda: [("trained", d)], family)
    print(f"{family}: {accepted} drafts accepted")
    assert accepted > 0, (family, top1)


def test_eagle3_sampling_output_distribution_equals_the_target(tmp_path):
    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=7)))
    feats = features(target, image_requests(8), tmp_path / "f", n_tokens=8)
    cfg = TrainConfig(epochs=6, batch_size=4, lr=3e-3, warmup_steps=1)
    out = train_drafter(Eagle3Method(ttt_steps=3), target, feats, tmp_path / "d", cfg)
    check_trained_drafter_samples(target, load_drafter(str(out), target), req, min_accepted=SAMPLED_FLOOR)


def write_safeailab(head, path) -> None:
    """An independent writer of SafeAILab's EAGLE-3 layout from a trained head's tensors: the authors' key names
    (midlayer.*, fc, norm, lm_head, d2t, t2d), fp16 pytorch_model.bin, their config template (no rope_theta)."""
    sd = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
             "embed_norm.weight": "midlayer.input_layernorm.weight", "hidden_norm.weight": "midlayer.hidden_norm.weight",
             "layer.post_norm.weight": "midlayer.post_attention_layernorm.weight", "d2t": "d2t", "t2d": "t2d"}
    for p in "qkvo":
        names[f"layer.{p}_proj.weight"] = f"midlayer.self_attn.{p}_proj.weight"
    for p in ("gate", "up", "down"):
        names[f"layer.{p}_proj.weight"] = f"midlayer.mlp.{p}_proj.weight"
    out = {names[k]: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
    path.mkdir(parents=True)
    torch.save(out, path / "pytorch_model.bin")
    c = head.cfg
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1,
        "vocab_size": c.target_vocab_size, "draft_vocab_size": c.draft_vocab_size, "rms_norm_eps": c.rms_eps,
        "model_type": "llama", "torch_dtype": "float16"}))


def test_a_trained_head_written_in_the_released_layout_proposes_the_same_trees(tmp_path):
    """Wiring: our trained head, saved in SafeAILab's layout by an independent writer and loaded back as a released
    head, proposes the same trees (on text prompts: released heads read the placeholder's token embedding at media
    positions, heads trained here the merged media embeddings; RoPE base 10000 on both sides here)."""
    target = wrap(*tiny_llava(init=0.3))
    feats = features(target, image_requests(8) + [Request(prompt="what is there")] * 2, tmp_path / "f")
    out = train_drafter(Eagle3Method(draft_vocab_size=80, ttt_steps=2), target, feats, tmp_path / "d",
                        TrainConfig(epochs=3, batch_size=4, lr=3e-3, warmup_steps=1))
    ours = load_drafter(str(out), target)
    assert ours.head.cfg.rope_theta == 10000.0
    ours.head.half().float()  # the released file is fp16: compare at the weights it holds
    write_safeailab(ours.head, tmp_path / "released")
    theirs = load_drafter(str(tmp_path / "released"), target)
    assert theirs.head.cfg.layout == "eagle3-safeailab"
    tree_cfg = TreeConfig(top_k=4, depth=3, total_tokens=16)
    for prompt in ("what is there", "describe"):
        req = Request(prompt=prompt)
        with torch.inference_mode():
            pre = target.prefill(target.encode(req))
            root = int(pre.logits[0, -1].argmax())
            trees = []
            for d in (ours, theirs):
                d.begin(target, pre, root)
                trees.append(d.propose(root, tree_cfg))
        assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
        assert trees[0].parents.tolist() == trees[1].parents.tolist()


def test_features_without_the_three_layers_are_refused_by_name(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    plain = load_features(generate_features(target, image_requests(2), DatagenRecipe(max_new_tokens=6), tmp_path / "f"))
    with pytest.raises(ValueError, match=r"eagle3 training needs \['aux'\]"):
        train_drafter(Eagle3Method(), target, plain, tmp_path / "d", TrainConfig(epochs=1))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_rotary_is_the_targets_own(family):
    """The head's M-RoPE (chunked sections on Qwen2.5-VL, interleaved on Qwen3-VL) rotates exactly as the target's
    own rotary embedding does, at 3-axis position ids that differ per axis."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb

    from mmspec_ray.drafters.layers import rotary

    target = build_target(family)
    cfg = Eagle3Drafter.random(target).head.cfg
    assert cfg.mrope_section and cfg.mrope_interleaved == (family == "qwen3_vl")
    layer = Eagle3Drafter.random(target).head.layer
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 11, layer.head_dim, generator=g)
    pos = torch.randint(0, 40, (3, 1, 11), generator=g)
    cos, sin = target.model.model.language_model.rotary_emb(q, pos)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(rotary(q, pos, cfg.rope_theta, layer.axes), want, atol=1e-5, rtol=1e-5)
    equal = pos[:1].expand(3, -1, -1)  # equal axes: plain 1-D RoPE
    torch.testing.assert_close(rotary(q, equal, cfg.rope_theta, layer.axes), rotary(q, pos[0], cfg.rope_theta))


@pytest.mark.parametrize("family,request_name", [("qwen2_5_vl", "video"), ("qwen2_5_vl", "image"),
                                                 ("qwen3_vl", "two_images")])
def test_mrope_head_drafts_at_the_positions_it_trains_at(family, request_name):
    """Train / draft parity of positions on an M-RoPE target: the drafter's outputs after `begin` (prompt entries
    at the target's 3-axis ids) and after observing answer tokens (generated entries at the target's rope delta)
    equal the teacher-forced training forward over the stored example (`positions` from data generation), entry
    for entry. A head placed at 1-D slot ids instead differs (checked)."""
    from mmspec_ray.drafters.layers import causal_pad_mask
    from mmspec_ray.targets.base import extend_inputs
    from mmspec_ray.training.datagen import featurize

    target = build_target(family)
    d = Eagle3Drafter.random(target, seed=3, std=0.3)
    req = FAMILIES[family].requests[request_name]
    answer = AREngine(target).generate(req, max_new_tokens=6).token_ids
    ex = featurize(target, req, answer, DatagenRecipe(aux_features=True, dtype="float32"))
    assert ex.positions is not None and ex.positions.shape == (3, ex.input_ids.shape[0])
    with torch.inference_mode():  # the three layers in float32 (stored in bfloat16), so both sides read the same
        ex = dataclasses.replace(ex, aux=d.features(target.prefill(extend_inputs(target.encode(req), answer)))[0])
    method = Eagle3Method(ttt_steps=1)
    batch = method.collate([ex], [0], 0.0, torch.Generator())
    with torch.no_grad():
        train = d.head(batch["emb"], batch["feat"], batch["pos"], causal_pad_mask(batch["valid"]))[0]
        slots = torch.arange(batch["emb"].shape[1])[None]
        flat = d.head(batch["emb"], batch["feat"], slots, causal_pad_mask(batch["valid"]))[0]
    n = ex.n_prompt
    with torch.inference_mode():
        pre = target.prefill(target.encode(req))
        d.begin(target, pre, answer[0])
        torch.testing.assert_close(d.last[0], train[n - 1], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(d.last[0], flat[n - 1], atol=1e-3)  # the ids matter here
        for k in range(1, 4):  # accept answer[k - 1] (already the root) with its features, bonus answer[k]
            d.observe([answer[k - 1]], ex.aux[n + k - 1:n + k].to(target.dtype), answer[k])
            torch.testing.assert_close(d.last[0], train[n - 1 + k], atol=1e-4, rtol=1e-4)
