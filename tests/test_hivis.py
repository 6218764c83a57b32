"""HiViS: no visual-token embedding ever enters the drafter (its prefill is the prompt's text, with
images and with video, on every family); tree nodes carry their level's sequential embedding; the parallel
multi-step training forward equals drafting chains step by step; dynamic data selection cuts a chain after a miss;
the mixed schedule, the answer filter and the stage switch; training lowers the loss, resumes across the stage
boundary and a trained drafter stays lossless (greedy == AR == HF on every family; sampling distribution)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.drafters.hivis import HiViSDrafter, HiViSHead
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features
from mmspec_ray.training.methods import (HiViSMethod, chain_alive, code_heavy, multi_step_forward,
                                         multi_step_mask, text_only, training_method)
from mmspec_ray.training.schedule import StageSchedule
from mmspec_ray.training.trainer import TrainConfig, train_drafter
from families import FAMILIES, build_target
from test_engine import check_greedy_lossless, check_learned
from tiny import random_images, tiny_llava

TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)
# HiViSMethod(min_answer_words=0) below: the tiny models answer in token soup with few spaces, so the paper's
# "more than five words" filter would drop every tiny example (tested on its own in test_filters_and_stage_switch)


def _features(target, reqs, path, n_tokens=16):
    return load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=n_tokens), path))


@pytest.mark.parametrize("family,request_name", [(f, r) for f, fam in FAMILIES.items() for r in fam.requests])
def test_no_visual_token_embedding_enters_the_drafter(family, request_name):
    """The drafter's prefill reads exactly the prompt's text positions: its fc sees the text tokens' embeddings
    (the next one's, EAGLE-style, the root's last) and the target's features there, never a media embedding; its
    positions are 0 .. l-1; eagle2 on the same prompt reads every position."""
    torch.manual_seed(0)
    target = build_target(family)
    drafter = HiViSDrafter.random(target, seed=3)
    seen = []
    hooks = [drafter.head.fc.register_forward_hook(lambda mod, args, out: seen.append(args[0][0].clone())),
             drafter.head.layer.register_forward_hook(lambda mod, args, out: seen.append(args[1][0].clone()))]
    pre = target.prefill(target.encode(FAMILIES[family].requests[request_name]))
    try:
        drafter.begin(target, pre, root=5)
    finally:
        for h in hooks:
            h.remove()
    fc_in, pos = seen
    media = pre.media_mask[0]
    text = ~media
    n_text, d = int(text.sum()), target.hidden_size
    assert (request_name == "text") == (not media.any())
    assert fc_in.shape[0] == n_text == drafter.prefill_tokens == drafter.ctx_len  # input length = text length
    assert torch.equal(pos, torch.arange(n_text))  # contiguous over the compressed sequence (1-D and M-RoPE alike)
    emb = pre.inputs_embeds[0]
    nxt = torch.cat([emb[text][1:], target.embed_tokens(torch.tensor([5]))], 0)
    assert torch.equal(fc_in[:, :d], nxt) and torch.equal(fc_in[:, d:], pre.hidden[0][text])
    for row in emb[media]:  # no media embedding anywhere in the drafter's input
        assert not (fc_in[:, :d] == row).all(-1).any()
    eagle = Eagle2Drafter.random(target, seed=3)
    eagle.begin(target, pre, root=5)
    assert eagle.prefill_tokens == media.numel() and n_text + int(media.sum()) == media.numel()


def test_tree_nodes_carry_their_levels_sequential_embedding():
    """Context entries use e_seq^0; a node at tree level j (its feature the drafter's j-th guess) e_seq^min(j, 3);
    a stage-1 drafter (one row trained) uses e_seq^0 everywhere."""
    target = wrap(*tiny_llava(init=0.3))
    d = HiViSDrafter.random(target, seed=2)
    steps: list[torch.Tensor | None] = []
    d.head.register_forward_pre_hook(lambda mod, args, kw: steps.append(kw.get("step")), with_kwargs=True)
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=4)))
    d.begin(target, target.prefill(target.encode(req)), root=5)
    tree = d.propose(5, TreeConfig(top_k=2, depth=5, total_tokens=10))
    assert steps[0] is None and [s.unique().tolist() for s in steps[1:]] == [[1], [2], [3], [4], [5]]
    x = torch.zeros(1, 5, target.hidden_size)
    out = d.head.with_step(x, torch.tensor([[0, 1, 2, 3, 7]]))
    assert torch.equal(out[0], d.head.seq_embed[[0, 1, 2, 3, 3]])  # threshold 3
    d.head.seq_rows.fill_(1)
    assert torch.equal(d.head.with_step(x, torch.tensor([[0, 1, 2, 3, 7]]))[0], d.head.seq_embed[[0] * 5])
    assert tree.size == 10


def test_parallel_multi_step_forward_equals_drafting_chains_step_by_step():
    """Pass f's output at t equals a chain started after real features up to a = t - f: the real context
    0..a with e_seq^0, then f self-fed entries (feature = the previous output, step j, position a + j)."""
    torch.manual_seed(0)
    target = wrap(*tiny_llava(init=0.3))
    head = HiViSDrafter.random(target, seed=5).head.float()
    B, T, dm = 2, 9, target.hidden_size
    emb, feat = torch.randn(B, T, dm), torch.randn(B, T, dm)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 7:] = False
    with torch.no_grad():
        outs = multi_step_forward(head, emb, feat, valid, 4)
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
                    g = head(emb[b:b + 1, t:t + 1], g, torch.tensor([[t]]), m, kv, a + j, step=torch.tensor([[j]]))
                    torch.testing.assert_close(outs[j][b, t], g[0, 0], atol=1e-5, rtol=1e-4)
    assert multi_step_mask(4, 2, valid[:, :4]).shape == (B, 1, 4, 12)


def test_dynamic_selection_cuts_a_chain_after_its_first_miss():
    hits = [torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool),
            torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=torch.bool),
            torch.tensor([[1, 1, 1, 1, 1, 1]], dtype=torch.bool),
            torch.tensor([[1, 1, 1, 1, 1, 1]], dtype=torch.bool)]
    alive = [a[0].int().tolist() for a in chain_alive(hits)]
    assert alive[0] == [1, 1, 1, 1, 1, 1]  # pass 0 unfiltered
    assert alive[1] == [0, 1, 1, 0, 1, 1]  # the chain from t=2 missed at pass 0: its pass 1 (t=3) is cut
    assert alive[2] == [0, 0, 1, 1, 0, 1]  # ... and its pass 2 (t=4); the chain from t=3 is intact at t=5
    assert alive[3] == [0, 0, 0, 1, 1, 0]  # the chain from t=2 missed at pass 0, the one from t=3 at pass 1 (t=4)


def test_mixed_schedule_draws_every_item_of_both_pools():
    s = StageSchedule(epochs=3, mixed=True)
    items = s.items(2, 5, 3, np.random.default_rng(0))
    assert sorted(items) == sorted([(True, i) for i in range(5)] + [(False, i) for i in range(3)])
    assert s.items_per_epoch(5, 3) == 8 and s.uses_text and not StageSchedule(epochs=3).uses_text
    assert [mm for mm, _ in s.items(1, 4, 0, np.random.default_rng(0))] == [True] * 4  # no text pool: media only


def test_filters_and_stage_switch(tmp_path):
    """Multimodal answers of at most five words are dropped; code-heavy text is flagged (stage 2 skips it); the
    stage-2 boundary copies e_seq^0 to every row once; features lose their media positions, nothing else."""
    target = wrap(*tiny_llava(init=0.3))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(3)], tmp_path / "mm", n_tokens=12)
    m = training_method("hivis")
    short = type(mm[0])(mm[0].input_ids[:mm[0].n_prompt + 2], mm[0].hidden[:mm[0].n_prompt + 2],
                        mm[0].embeds[:mm[0].n_prompt + 2], mm[0].n_prompt, mm[0].media[:mm[0].n_prompt + 2])
    words = [len(target.tokenizer.decode(e.input_ids[e.n_prompt:].tolist(), skip_special_tokens=True).split())
             for e in mm + [short]]
    kept, text = m.select(target, mm + [short], [])
    assert len(kept) == sum(w > 5 for w in words) and short not in kept and words[-1] <= 5
    assert code_heavy("```python\nprint(1)\n```") and code_heavy("def f(x): return {x[0]: x[1]};")
    assert not code_heavy("The picture shows a red star above a small blue house near the river.")
    c = text_only(mm[0])
    keep = ~mm[0].media
    assert torch.equal(c.input_ids, mm[0].input_ids[keep]) and torch.equal(c.hidden, mm[0].hidden[keep])
    assert c.n_prompt == mm[0].n_prompt - int(mm[0].media.sum()) and not c.media.any()
    assert target.media_token_ids.isdisjoint(c.input_ids.tolist())
    head = m.head(target)
    with torch.no_grad():
        head.seq_embed[0] = 1.0
    cfg = TrainConfig(epochs=6, multistep_epochs=2)
    for e in range(1, 5):
        m.begin_epoch(head, e, cfg)
        assert m.n_passes == 1 and int(head.seq_rows) == 1
    m.begin_epoch(head, 5, cfg)
    assert m.n_passes == 4 and int(head.seq_rows) == 4 and bool((head.seq_embed == 1.0).all())
    with torch.no_grad():
        head.seq_embed[2] = 2.0
    m.begin_epoch(head, 6, cfg)  # not the boundary: trained rows kept
    assert bool((head.seq_embed[2] == 2.0).all())
    assert m.multistep_epochs(TrainConfig(epochs=8)) == 3


def test_hivis_training_lowers_the_loss_resumes_into_stage_2_and_stays_lossless(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(10)], tmp_path / "mm")
    text = _features(target, [Request(prompt=f"describe {w} the image") for w in
                              ("a", "one", "what", "is", "the", "this", "big", "red")], tmp_path / "text")
    cfg = TrainConfig(epochs=3, batch_size=2, lr=3e-3, warmup_steps=2, eval_max_new_tokens=8, multistep_epochs=0)
    heldout = [Request(prompt="describe the image", images=tuple(random_images(1, seed=100)))]
    out = train_drafter(HiViSMethod(min_answer_words=0), target, mm, tmp_path / "d", cfg, heldout=heldout, text_examples=text)
    hist = json.loads((out / "history.json").read_text())
    n_mm = hist[0]["items"]["multimodal"]
    assert hist[0]["items"]["text"] == len(text) and 0 < n_mm <= len(mm)  # both pools every epoch
    s1 = HiViSHead.load(out)
    assert int(s1.seq_rows) == 1 and "kept_pass1" not in hist[-1]  # stage 1 only: one row, one pass
    # resume with more epochs: stage 2 starts from the stage-1 checkpoint (the paper's two runs)
    out = train_drafter(HiViSMethod(min_answer_words=0), target, mm, tmp_path / "d",
                        cfg.model_copy(update={"epochs": 5, "multistep_epochs": 2}),
                        heldout=heldout, text_examples=text)
    hist = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4, 5]
    assert all(f"kept_pass{f}" in hist[-1] for f in range(4)) and hist[-1]["kept_pass0"] == 1.0
    assert 0 < hist[-1]["kept_pass3"] <= hist[-1]["kept_pass1"] <= 1.0  # selection cuts deeper steps more
    s2 = HiViSHead.load(out)
    assert int(s2.seq_rows) == 4 and not torch.equal(s2.seq_embed[1], s2.seq_embed[0])
    m, W = training_method("hivis"), target.model.get_output_embeddings().weight.detach().float()
    batch = m.collate(mm, list(range(len(mm))), 0.0, torch.Generator())
    torch.manual_seed(cfg.seed)  # the trainer's initial head
    init = m.head(target).float()
    with torch.no_grad():
        m.filter_k = target.vocab_size  # every chain kept: the same positions before and after
        for passes in (4, 1):  # stage 2's loss (four passes, top-K term) and stage 1's both fell
            m.n_passes = passes
            before, after = m.loss(init, batch, W, 0.1)[0].item(), m.loss(s2.float(), batch, W, 0.1)[0].item()
            assert after < 0.9 * before, (passes, before, after)
    assert json.loads((out / "config.json").read_text())["method"] == "hivis"
    d = load_drafter(str(out), target)
    assert isinstance(d, HiViSDrafter) and isinstance(d.head, HiViSHead)
    for i in range(3):
        req = Request(prompt="describe the image", images=tuple(random_images(1, seed=200 + i)))
        assert SpecEngine(target, d, TREE).generate(req, max_new_tokens=24).token_ids == \
            AREngine(target).generate(req, max_new_tokens=24).token_ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_hivis_is_lossless_on_every_family_and_request(family, tmp_path):
    """Briefly trained (both stages) on the family's own requests; greedy spec == AR == HF generate on each."""
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    media = [r for n, r in reqs.items() if n != "text"]
    mm = _features(target, media * 2, tmp_path / "mm", n_tokens=12)
    text = _features(target, [reqs["text"], Request(prompt="what is there")], tmp_path / "text", n_tokens=12)
    cfg = TrainConfig(epochs=6, batch_size=2, lr=3e-3, warmup_steps=1, multistep_epochs=3)
    out = train_drafter(HiViSMethod(min_answer_words=0), target, mm, tmp_path / "d", cfg, text_examples=text)
    top1 = check_learned(out, key="top1_pass0")
    d = load_drafter(str(out), target)
    accepted = check_greedy_lossless(target, reqs, lambda: [("trained", d)], family)
    print(f"{family}: {accepted} drafts accepted")
    assert accepted > 0, (family, top1)  # drafts were accepted: the drafter's observe / KV path after acceptance ran


def test_hivis_sampling_output_distribution_equals_the_target(tmp_path):
    """An image request at T 0.8, top-k 4, top-p 0.9 through a briefly trained HiViS drafter: 3-token answers
    match the exact warped target distribution (chi-square at p = 1e-4, 1,500 samples)."""
    from test_engine import SAMPLED_FLOOR, check_trained_drafter_samples

    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=7)))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(8)], tmp_path / "mm", n_tokens=8)
    cfg = TrainConfig(epochs=6, batch_size=4, lr=3e-3, warmup_steps=1, multistep_epochs=3)
    out = train_drafter(HiViSMethod(min_answer_words=0), target, mm, tmp_path / "d", cfg)
    d = load_drafter(str(out), target)
    check_trained_drafter_samples(target, d, req, min_accepted=SAMPLED_FLOOR)


def test_bench_reports_the_drafter_prefill_length(tmp_path):
    """Per request, the tokens each drafter's begin read beside the prompt's: eagle2 all, hivis the text only."""
    from mmspec_ray.bench.run import BenchConfig, run_bench, to_markdown

    target = wrap(*tiny_llava(init=0.3))
    Eagle2Drafter.random(target, seed=1).head.save(tmp_path / "e")
    HiViSDrafter.random(target, seed=1).head.save(tmp_path / "h")
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=3)))
    cfg = BenchConfig(prompts=1, max_new_tokens=8, repeats=1, temperatures=(0.0,),
                      tree=TreeConfig(top_k=2, depth=2, total_tokens=6))
    res = run_bench(target, [req], {"eagle2": str(tmp_path / "e"), "hivis": str(tmp_path / "h")}, cfg)
    rows = res["summary"]["0.0"]
    ids = target.encode(req)["input_ids"][0]
    n_media = sum(int((ids == t).sum()) for t in target.media_token_ids)
    assert rows["eagle2"]["drafter_prefill_tokens"] == rows["eagle2"]["prompt_tokens"] == ids.numel()
    assert rows["hivis"]["drafter_prefill_tokens"] == ids.numel() - n_media > 0 and n_media > 0
    assert rows["ngram"]["drafter_prefill_tokens"] == 0
    assert "drafter prefill tokens/request" in to_markdown(res, "tiny")
