"""SpecFLASH: C learnable queries attention-pool each image / video frame of every family; one drafter
forward drafts K tokens (slot j predicts token x_{n+2+j}), and deeper trees chain groups of K (the drafted tokens fed
back with their slots' features); training's placeholder expansion computes exactly what inference drafts, on
LLaVA, Qwen2.5-VL and LLaVA-OneVision clips alike; training lowers the loss and resumes; a briefly trained
drafter, chain or tree, chained or not, stays lossless greedy on every family and in distribution when sampling."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.specflash import (SpecFlashConfig, SpecFlashDrafter, SpecFlashHead, cartesian_tree,
                                           compressed_count)
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from mmspec_ray.targets.base import TargetOutput, pieces_of, prefill_pieces
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features
from mmspec_ray.training.methods import SpecFlashMethod, training_method
from mmspec_ray.training.specflash import layer_inputs
from mmspec_ray.training.trainer import TrainConfig, train_drafter
from families import FAMILIES, build_target
from test_engine import check_greedy_lossless, check_learned, with_cfg
from tiny import random_images, tiny_llava

TREE = TreeConfig(top_k=4, depth=3, total_tokens=20)  # 4 levels: one group of K = 4


def drafter_with(target, ratio: float, group: int = 4, draft: str = "chain", seed: int = 1,
                 placeholder: str = "learned", chain_groups: bool = True) -> SpecFlashDrafter:
    """An untrained drafter with these settings (default initialisation from `seed`)."""
    torch.manual_seed(seed)
    cfg = SpecFlashConfig.for_target(target).model_copy(update={"ratio": ratio, "group": group, "draft": draft,
                                                                "placeholder": placeholder,
                                                                "chain_groups": chain_groups})
    return SpecFlashDrafter(SpecFlashHead(cfg), target)


def begin_inputs(drafter: SpecFlashDrafter, target, req: Request) -> tuple[torch.Tensor, TargetOutput]:
    """(decoder-layer input [S, d] of `begin` on `req`: the run context + the queued last entry, prefill)."""
    seen = []
    hook = drafter.head.layer.register_forward_hook(lambda mod, args, out: seen.append(args[0][0].clone()))
    pre = target.prefill(target.encode(req))
    try:
        drafter.begin(target, pre, root=5)
    finally:
        hook.remove()
    return torch.cat(seen + [drafter.pending]), pre


@pytest.mark.parametrize("family,request_name", [(f, r) for f, fam in FAMILIES.items() for r in fam.requests
                                                 if r != "text"])
@pytest.mark.parametrize("ratio", [1.0, 0.25, 1 / 9, 0.0])
def test_each_image_or_frame_is_pooled_into_c_query_vectors(family, request_name, ratio):
    """Every image / frame (`media_segments`) becomes C = compressed_count(N) vectors softmax(Q F^T) F of its own
    features, at its place in the sequence; text entries keep fc([e_{j+1}; f_j]); C/N 1 keeps F, 0 drops it."""
    torch.manual_seed(0)
    target = build_target(family)
    d = drafter_with(target, ratio)
    x, pre = begin_inputs(d, target, FAMILIES[family].requests[request_name])
    seg, hid, emb = pre.media_segments[0], pre.hidden[0], pre.inputs_embeds[0]
    assert torch.equal(seg >= 0, pre.media_mask[0])
    pieces = [torch.nonzero(seg == i).flatten() for i in range(int(seg.max()) + 1)]
    assert len(pieces) >= 1 and all(p.numel() and int(p[-1] - p[0]) + 1 == p.numel() for p in pieces)
    if family == "llava" and request_name == "video":
        assert len(pieces) == 4  # one piece per frame, not one per run of placeholders
    n_text = int((seg < 0).sum())
    cs = [compressed_count(p.numel(), ratio, d.head.cfg.max_queries) for p in pieces]
    assert x.shape[0] == n_text + sum(cs) == d.prefill_tokens
    if 0 < ratio < 1:
        assert all(1 <= c < p.numel() for c, p in zip(cs, pieces))
    nxt = torch.cat([emb[1:], target.embed_tokens(torch.tensor([5]))], 0)
    with torch.no_grad():
        fused = d.head.fc(torch.cat([nxt, hid], -1))
    row, j = 0, 0
    while j < seg.shape[0]:
        if seg[j] < 0:
            torch.testing.assert_close(x[row], fused[j])
            row, j = row + 1, j + 1
            continue
        p = pieces[int(seg[j])]
        f = hid[p]
        want = f if ratio >= 1 else torch.softmax(d.head.queries[:cs[int(seg[j])]] @ f.T, -1) @ f
        torch.testing.assert_close(x[row:row + want.shape[0]], want)
        row, j = row + want.shape[0], j + p.numel()
    assert row == x.shape[0]


@pytest.mark.parametrize("chain_groups", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4, 6])
def test_one_forward_drafts_k_tokens(group, chain_groups):
    """propose = one decoder-layer forward per group of K drafted tokens: without chaining, one forward and at most
    K tokens; with it, min(depth + 1, total_tokens - 1) tokens (the depth + 1 levels every drafter and the
    calibrator count) in ceil(that / K) forwards, whatever the context."""
    target = wrap(*tiny_llava(init=0.3))
    d = drafter_with(target, 1 / 9, group=group, chain_groups=chain_groups)
    req = Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),))
    calls = []
    d.head.layer.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[1]))
    pre = target.prefill(target.encode(req))
    d.begin(target, pre, root=5)
    n_begin, passes = len(calls), 0
    for cfg in (TreeConfig(top_k=4, depth=8, total_tokens=20), TreeConfig(top_k=4, depth=3, total_tokens=20),
                TreeConfig(top_k=4, depth=8, total_tokens=6)):
        before, ctx, queued = len(calls), d.ctx_len, d.pending.shape[0]
        tree = d.propose(5, cfg)
        n = min(cfg.depth + 1, cfg.total_tokens - 1)
        n = n if chain_groups else min(n, group)
        forwards = -(-n // group)
        assert len(calls) == before + forwards  # ONE drafter forward per group of K
        assert tree.size - 1 == n and tree.parents.tolist() == list(range(-1, tree.size - 1))
        assert d.ctx_len == ctx + queued  # the queued entries became context; fed-back drafts did not
        passes += forwards
        d.observe([5, 7], torch.randn(2, target.hidden_size), bonus=9)  # queued, not run
        assert len(calls) == before + forwards
    assert d.passes == passes and n_begin <= 1


def reference_groups(d: SpecFlashDrafter, x: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Chained drafting step by step, without a KV cache: the real entries x [S, d] (context + queued) and K-1
    placeholders through the layer, causal over the whole sequence at positions 0..; the k slots' argmax tokens
    and outputs appended as entries fc([e(d); out]); again, until n tokens. Returns the log-probs [n, V] and the
    layer inputs of every group after the first (fed entries + placeholders)."""
    head, K = d.head, d.head.cfg.group
    logps, inputs, seq = [], [], x
    while sum(lp.shape[0] for lp in logps) < n:
        k = min(K, n - sum(lp.shape[0] for lp in logps))
        ph = head.placeholders[:k - 1] + (seq[-1:] if head.cfg.placeholder == "offset" else 0)
        if logps:
            inputs.append(torch.cat([seq[-K:], ph]))
        full = torch.cat([seq, ph])
        T = full.shape[0]
        out = head.layer(full[None], torch.arange(T)[None], torch.ones(T, T, dtype=torch.bool).tril()[None, None])[0]
        slots = out[seq.shape[0] - 1:seq.shape[0] - 1 + k]
        lp = torch.log_softmax(d.target.lm_head(slots).float(), -1)
        logps.append(lp)
        seq = torch.cat([seq, head.fc(torch.cat([d.target.embed_tokens(lp.argmax(-1)), slots], -1))])
    return torch.cat(logps), inputs


@pytest.mark.parametrize("placeholder", ["learned", "offset"])
def test_chained_groups_feed_the_drafted_tokens_back_with_their_features(placeholder):
    """K = 2, depth 5 (6 levels): three forwards draft 6 tokens; the second and third forwards' inputs are the previous
    group's tokens paired with its slots' outputs, fc([e(d_s); f^_s]), then the placeholders, and every slot's
    distribution is what a step-by-step uncached run gives; the fed entries' KV is scratch (the next cycle drafts
    as if they had never run)."""
    target = wrap(*tiny_llava(init=0.3))
    d = drafter_with(target, 1 / 9, group=2, placeholder=placeholder)
    d.head.float()
    req = Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),))
    x, _ = begin_inputs(d, target, req)
    cfg = TreeConfig(top_k=4, depth=5, total_tokens=20)
    seen = []
    hook = d.head.layer.register_forward_hook(lambda mod, args, out: seen.append(args[0][0].clone()))
    try:
        with torch.no_grad():
            want, fed = reference_groups(d, x, 6)
        seen.clear()
        tree = d.propose(5, cfg)
        assert tree.size == 7 and tree.tokens[1:].tolist() == want.argmax(-1).tolist()
        assert len(seen) == 3 and d.passes == 3
        for got, ref in zip(seen[1:], fed):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        # the next cycle: 2 drafts accepted, the target's features queued; drafting continues from the context
        hid = torch.randn(3, target.hidden_size, generator=torch.Generator().manual_seed(0))
        accepted = [5] + tree.tokens[1:3].tolist()
        d.observe(accepted, hid, bonus=11)
        with torch.no_grad():
            new = d.head.fc(torch.cat([target.embed_tokens(torch.tensor(accepted[1:] + [11])), hid], -1))
            want2, _ = reference_groups(d, torch.cat([x, new]), 6)
        seen.clear()
        logp, spine = d.draft_logprobs(6)
    finally:
        hook.remove()
    torch.testing.assert_close(logp, want2, atol=1e-5, rtol=1e-5)
    assert spine == want2.argmax(-1).tolist() and d.ctx_len == x.shape[0] + 3


def test_chained_tree_hangs_later_groups_under_the_argmax_path():
    """draft "tree" with chaining: the first group is the per-slot top-k tree; a later group's nodes descend only
    from the node ending the first group's argmax path (the only path it was drafted after), and a later group is
    drafted only while that node is among the best `total_tokens - 1`."""
    target = wrap(*tiny_llava(init=0.3))
    d = drafter_with(target, 1 / 9, group=2, draft="tree")
    begin_inputs(d, target, Request(prompt="describe the image", images=tuple(random_images(1, seed=1))))
    tree = d.propose(5, TreeConfig(top_k=2, depth=3, total_tokens=40))  # 4 levels: two groups
    par, dep, tok = tree.parents.tolist(), tree.depth.tolist(), tree.tokens.tolist()
    assert max(dep) == 4 and d.passes == 2
    spine = [0]
    while True:  # follow the argmax (rank 0, highest-scoring child) path through the first group
        kids = [i for i in range(tree.size) if par[i] == spine[-1]]
        if not kids or dep[spine[-1]] == 2:
            break
        spine.append(max(kids, key=lambda i: float(tree.scores[i])))
    assert [dep[i] for i in spine] == [0, 1, 2]
    for i in range(tree.size):
        if dep[i] == 3:
            assert par[i] == spine[-1]
    assert sum(dep[i] == 3 for i in range(tree.size)) == 2 and sum(dep[i] == 2 for i in range(tree.size)) == 4
    # budget 4 with near-uniform slots: the four best first tokens outscore every 2-token path, so the first
    # group's argmax path ends outside the tree and no later group is drafted
    d.logprobs = lambda out: torch.log_softmax(target.lm_head(out).float() * 0.01, -1)
    passes = d.passes
    d.observe([5, 7], torch.randn(2, target.hidden_size), bonus=9)
    small = d.propose(5, TreeConfig(top_k=4, depth=6, total_tokens=5))
    assert d.passes == passes + 1 and small.size == 5 and int(small.depth.max()) == 1
    logp = torch.log_softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(1)), -1)
    flat = cartesian_tree(7, logp, top_k=2, budget=100, group=2, spine=logp.argmax(-1).tolist())
    assert flat.size - 1 == 2 + 4 + 2 + 4  # 2 + 4 nodes in group 1; 2 + 4 under the spine's end in group 2
    assert tok[0] == 5 and cartesian_tree(7, logp, 2, 100).size - 1 == 2 + 4 + 8 + 16  # unchained: every node


def parity_case(family: str):
    """(target, stored example of a clip request, its real prefill) for the train / draft parity check."""
    from mmspec_ray.training.datagen import answer_and_featurize

    torch.manual_seed(0)
    target = build_target(family)
    req = FAMILIES[family].requests["video"]
    ex = answer_and_featurize(target, req, DatagenRecipe(max_new_tokens=12, dtype="float32"))
    with torch.inference_mode():
        pre = target.prefill(target.encode(req))
    return target, ex, pre


@pytest.mark.parametrize("placeholder", ["learned", "offset"])
@pytest.mark.parametrize("family,frames", [("llava", 4), ("qwen2_5_vl", 2), ("llava_onevision", 4)])
def test_training_expansion_computes_what_inference_drafts(family, frames, placeholder):
    """On a clip of each video family: training cuts the media into the pieces stored at data generation, which
    are the real prefill's (per frame, or per temporal group on Qwen2.5-VL); slot s of base j gives the same draft
    distributions in training (block-diagonal placeholders, noise 0) and inference (begin on the prefill + observe
    + one propose forward), and slot s's target is f_{j+1+s} (token x_{j+2+s})."""
    target, ex, pre = parity_case(family)
    pieces = ex.pieces()
    assert pieces == pieces_of(pre.media_segments[0]) == prefill_pieces(pre, target) and len(pieces) == frames
    if family != "llava":  # the ids alone leave the clip whole: only the stored cut matches drafting's
        assert len(target.media_pieces(ex.input_ids)) == 1
    n_p, L, ids, hid = ex.n_prompt, ex.input_ids.shape[0], ex.input_ids.tolist(), ex.hidden.float()
    assert n_p == pre.hidden.shape[1] and L - n_p >= 6
    d = drafter_with(target, 1 / 9, group=4, placeholder=placeholder)
    d.head.float()
    item = with_head(d.head).collate([ex], [0], 0.0, torch.Generator())["items"][0]
    assert item["pieces"].shape[0] == frames and item["piece_len"].tolist() == [b - a for a, b in pieces]
    with torch.no_grad():
        out = d.head.layer(layer_inputs(d.head, item)[None], item["pos"][None], item["mask"][None, None])[0]
    W = target.model.get_output_embeddings().weight.float()
    R = int((item["kind"] != 4).sum())
    for j in (n_p - 1, n_p + 2):  # the first base (the prompt's last entry) and one inside the answer
        d.begin(target, pre, root=ids[n_p])  # the prefill's own media_segments
        assert d.prefill_tokens == R - (L - 1 - n_p)
        if j >= n_p:
            d.observe(ids[n_p:j + 1], hid[n_p:j + 1], bonus=ids[j + 1])
        inf, _ = d.draft_logprobs(4)
        i = R - (L - 1 - j)  # the real row of entry j (the answer's entries are the last rows of the real part)
        b = j - (n_p - 1)  # its placeholder block
        rows = [i] + [R + 3 * b + s for s in range(3)]
        train = torch.log_softmax(out[rows] @ W.T, -1)
        torch.testing.assert_close(inf, train, atol=1e-4, rtol=1e-4)
        for s, r in enumerate(rows):
            assert item["pos"][r] == i + s
            if j + 1 + s <= L - 2:
                assert item["loss_mask"][r] and torch.equal(item["tgt"][r], hid[j + 1 + s])


def with_head(head: SpecFlashHead) -> SpecFlashMethod:
    """A SpecFLASH training method whose collate uses `head`'s config and no target (pieces stored with the
    example, as on Ray Train workers)."""
    m = SpecFlashMethod()
    m.cfg = head.cfg
    return m


def test_cartesian_tree_is_best_first_within_budget():
    logp = torch.log_softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    t = cartesian_tree(7, logp, top_k=3, budget=15)
    assert t.size == 16 and int(t.depth.max()) <= 4 and t.tokens[0] == 7
    par, sc = t.parents.tolist(), t.scores.tolist()
    assert all(0 <= par[i] < i for i in range(1, t.size))
    top = torch.topk(logp, 3, -1)
    for i in range(1, t.size):
        s = int(t.depth[i]) - 1
        assert int(t.tokens[i]) in top.indices[s].tolist()
        assert sc[i] == pytest.approx(sc[par[i]] + float(logp[s, int(t.tokens[i])]), abs=1e-5)
    # the kept nodes are the best 15 of the full tree (no dropped node outscores a kept one)
    full = cartesian_tree(7, logp, top_k=3, budget=3 + 9 + 27 + 81)
    assert sorted(sc[1:], reverse=True) == pytest.approx(sorted(full.scores.tolist()[1:], reverse=True)[:15])
    assert cartesian_tree(7, logp, top_k=1, budget=10).tokens[1:].tolist() == logp.argmax(-1).tolist()  # = chain


def _features(target, reqs, path, n_tokens=16):
    return load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=n_tokens), path))


def test_specflash_training_lowers_the_loss_resumes_and_stays_lossless(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(8)]
                   + [Request(prompt="what is happening", videos=(tuple(random_images(3, seed=50 + i)),))
                      for i in range(4)], tmp_path / "mm")
    cfg = TrainConfig(epochs=2, batch_size=4, lr=1e-2, warmup_steps=2, eval_max_new_tokens=8)
    heldout = [Request(prompt="describe the image", images=tuple(random_images(1, seed=100)))]
    out = train_drafter("specflash", target, mm, tmp_path / "d", cfg, heldout=heldout)
    out = train_drafter("specflash", target, mm, tmp_path / "d", cfg.model_copy(update={"epochs": 8}),
                        heldout=heldout)
    hist = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in hist] == list(range(1, 9)) and "top1_slot3" in hist[-1]
    m, W = training_method("specflash"), target.model.get_output_embeddings().weight.detach().float()
    torch.manual_seed(cfg.seed)  # the trainer's initial head
    head0 = m.head(target).float()
    batch = m.collate(mm, list(range(len(mm))), 0.0, torch.Generator())
    with torch.no_grad():
        before = m.loss(head0, batch, W, 0.1)[0].item()
        after = m.loss(SpecFlashHead.load(out).float(), batch, W, 0.1)[0].item()
    assert after < 0.9 * before, (before, after)  # slots 1-3 of a random tiny target are hard to guess
    assert json.loads((out / "config.json").read_text())["method"] == "specflash"
    d = load_drafter(str(out), target)
    assert isinstance(d, SpecFlashDrafter)
    with pytest.raises(ValueError, match="holds a specflash training run, not eagle2"):
        train_drafter("eagle2", target, mm, tmp_path / "d", cfg.model_copy(update={"epochs": 9}))
    accepted = 0
    for draft in ("chain", "tree"):
        d.head.cfg = d.head.cfg.model_copy(update={"draft": draft})
        for i in range(3):
            req = Request(prompt="describe the image", images=tuple(random_images(1, seed=200 + i)))
            g = SpecEngine(target, d, TREE).generate(req, max_new_tokens=24)
            assert g.token_ids == AREngine(target).generate(req, max_new_tokens=24).token_ids
            accepted += sum(g.stats.accepted_per_cycle)
            assert g.stats.draft_passes <= g.stats.cycles  # one forward per proposing cycle, at most
    assert accepted > 0


def test_method_options_set_the_head_config():
    target = wrap(*tiny_llava(init=0.3))
    head = SpecFlashMethod(ratio=0.25, group=2, max_queries=8).head(target)
    assert (head.cfg.ratio, head.cfg.group, head.cfg.max_queries) == (0.25, 2, 8)
    assert head.queries.shape == (8, target.hidden_size) and head.placeholders.shape == (1, target.hidden_size)
    assert head.cfg.chain_groups  # chaining is on by default; `--method-option chain_groups=false` saves it off
    assert training_method("specflash", {"chain_groups": False}).head(target).cfg.chain_groups is False
    with pytest.raises(ValueError, match="placeholder"):  # options are checked against the config's fields
        SpecFlashMethod(placeholder="bogus").head(target)
    assert [compressed_count(9, r, 64) for r in (1, 1 / 4, 1 / 9, 1 / 16, 0)] == [9, 2, 1, 1, 0]
    assert [compressed_count(576, r, 64) for r in (1 / 4, 1 / 9, 1 / 16)] == [64, 64, 36]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_specflash_is_lossless_on_every_family_and_request(family, tmp_path):
    """Briefly trained on the family's own media requests; greedy spec (chain and tree) == AR == HF generate."""
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    mm = _features(target, [r for n, r in reqs.items() if n != "text"] * 2, tmp_path / "mm", n_tokens=12)
    cfg = TrainConfig(epochs=8, batch_size=2, lr=1e-2, warmup_steps=1)
    out = train_drafter("specflash", target, mm, tmp_path / "d", cfg)
    top1 = check_learned(out, floor=0.05, key="top1_slot0")  # llava: 0.14-0.18 by kernel (raw media, see msd)
    d = load_drafter(str(out), target)
    shapes = lambda: ((draft, with_cfg(d, draft=draft)) for draft in ("chain", "tree"))  # noqa: E731
    accepted = check_greedy_lossless(target, reqs, shapes, family)
    print(f"{family}: {accepted} drafts accepted")
    assert accepted > 0, (family, top1)  # drafts were accepted: the drafter's queue / KV path after acceptance ran


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_chained_groups_stay_lossless(family, tmp_path):
    """A K = 2 drafter fitted to the family's requests, on trees deeper than K (depth 4: 5 levels, three chained
    groups per cycle; depth 6: 7 levels, four), chain and tree, and an untrained one: greedy spec == AR == HF, and drafts of a chained
    group (beyond the first K) are accepted, so the scratch KV of fed-back drafts is exercised through acceptance."""
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    mm = _features(target, [r for n, r in reqs.items() if n != "text"] * 2, tmp_path / "mm", n_tokens=24)
    out = train_drafter(SpecFlashMethod(group=2), target, mm, tmp_path / "d",  # fits the requests' own answers
                        TrainConfig(epochs=100, batch_size=2, lr=1e-2, warmup_steps=1))
    check_learned(out, floor=0.5, key="top1_slot1")  # 0.89 on both; slot 1 is the slow one to learn
    d = load_drafter(str(out), target)
    assert d.head.cfg.group == 2 and d.head.cfg.chain_groups
    untrained = drafter_with(target, 1 / 9, group=2)
    shapes = lambda: ((draft, with_cfg(d, draft=draft)) for draft in ("chain", "tree"))  # noqa: E731
    check_greedy_lossless(target, reqs, lambda: [*shapes(), ("untrained", untrained)], family)  # depth 4
    deep, beyond = TreeConfig(top_k=4, depth=6, total_tokens=20), 0
    for req in reqs.values():
        ar = AREngine(target).generate(req, max_new_tokens=24).token_ids
        for draft in ("chain", "tree"):
            g = SpecEngine(target, with_cfg(d, draft=draft), deep).generate(req, max_new_tokens=24)
            assert g.token_ids == ar, (family, req.prompt, draft)
            beyond += sum(a > 2 for a in g.stats.accepted_per_cycle)
            assert g.stats.draft_passes <= 4 * g.stats.cycles
    assert beyond > 0, family  # cycles that accepted tokens of a chained group


@pytest.mark.parametrize("draft", ["chain", "tree"])
def test_specflash_sampling_output_distribution_equals_the_target(draft, tmp_path):
    """An image request at T 0.8, top-k 4, top-p 0.9 through a briefly trained SpecFLASH drafter: 3-token answers
    match the exact warped target distribution (chi-square at p = 1e-4, 1,500 samples)."""
    from test_engine import SAMPLED_FLOOR, check_trained_drafter_samples

    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=7)))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(8)], tmp_path / "mm", n_tokens=8)
    cfg = TrainConfig(epochs=8, batch_size=4, lr=1e-2, warmup_steps=1)
    out = train_drafter("specflash", target, mm, tmp_path / "d", cfg)
    d = load_drafter(str(out), target)
    d.head.cfg = d.head.cfg.model_copy(update={"draft": draft})
    check_trained_drafter_samples(target, d, req, min_accepted=SAMPLED_FLOOR)
