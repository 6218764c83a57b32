"""ViSpec: the vision adaptor compresses every image / frame of every family into n_c tokens at the
piece's last position ids (text keeps its own), the global feature reaches every later text entry and stops at
the next image (a clip's frames pool theirs), training computes what inference drafts (images, and clips cut by
temporal group or frame), each objective is the loss it names (the paper's soft CE by default), loss falls and
resumes, MTP runs in stage 2 only, and a briefly trained drafter stays lossless on one image, several images and video
of every family, greedy and sampled."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.vispec import ViSpecConfig, ViSpecDrafter, ViSpecHead, entry_spans, media_runs_of
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from mmspec_ray.targets.base import TargetOutput, pieces_of
from mmspec_ray.toy.prompts import at_length
from mmspec_ray.training.cli import method_options
from mmspec_ray.training.datagen import DatagenRecipe, answer_and_featurize, generate_features, load_features
from mmspec_ray.training.losses import eagle_loss
from mmspec_ray.training.methods import ViSpecMethod, training_method
from mmspec_ray.training.trainer import TrainConfig, stage_schedule, train_drafter
from mmspec_ray.training.vispec import OBJECTIVES, vispec_forward
from families import FAMILIES, build_target
from test_engine import check_greedy_lossless, check_learned
from tiny import random_images, tiny_llava

TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)


def random_head(target, compressed: int = 1, seed: int = 1) -> ViSpecHead:
    """A head with every weight random (img_fc's g half included, so g visibly changes the fused inputs)."""
    d = ViSpecDrafter.random(target, seed=seed)
    if compressed != 1:
        g = torch.Generator().manual_seed(seed)
        head = ViSpecHead(d.head.cfg.model_copy(update={"compressed": compressed}))
        with torch.no_grad():
            for p in head.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        d = ViSpecDrafter(head, target)
    return d.head.float()


def begin_rows(drafter: ViSpecDrafter, target, req: Request) -> tuple[torch.Tensor, torch.Tensor, TargetOutput]:
    """(decoder-layer inputs [S, d] and position ids [S] of `begin` on `req`, the prefill)."""
    seen = []
    hook = drafter.head.layer.register_forward_hook(lambda mod, args, out: seen.append((args[0][0], args[1][0])))
    pre = target.prefill(target.encode(req))
    try:
        drafter.begin(target, pre, root=5)
    finally:
        hook.remove()
    return seen[0][0], seen[0][1], pre


@pytest.mark.parametrize("family,request_name", [(f, r) for f, fam in FAMILIES.items() for r in fam.requests])
@pytest.mark.parametrize("compressed", [1, 4])
def test_adaptor_emits_the_configured_tokens_per_image_at_its_last_positions(family, request_name, compressed):
    """Every image / frame (`media_segments`) becomes exactly n_c adaptor outputs of its own media embeddings,
    placed at the piece's last n_c entry positions; every text entry keeps its uncompressed position id."""
    torch.manual_seed(0)
    target = build_target(family)
    d = ViSpecDrafter(random_head(target, compressed), target)
    x, pos, pre = begin_rows(d, target, FAMILIES[family].requests[request_name])
    pieces = pieces_of(pre.media_segments[0])
    n = pre.hidden.shape[1]
    spans = entry_spans(pieces)
    if request_name == "text":
        assert pieces == [] and torch.equal(pos, torch.arange(n))
    else:
        assert len(pieces) >= (2 if request_name in ("two_images", "video") else 1)
    if family == "llava" and request_name == "video":
        assert len(pieces) == 4  # one piece per frame
    in_media = sum(e - s for s, e in spans)
    assert x.shape[0] == n - in_media + compressed * len(spans) == d.prefill_tokens
    assert d.pos_offset + d.ctx_len == n  # decoding continues the uncompressed count
    nxt = torch.cat([pre.inputs_embeds[0][1:], target.embed_tokens(torch.tensor([5]))], 0)
    media_pos = {j for s, e in spans for j in range(s, e)}
    text_pos = [j for j in range(n) if j not in media_pos]
    assert sorted(p for p in pos.tolist() if p not in media_pos) == text_pos
    for s, e in spans:
        rows = torch.nonzero((pos >= s) & (pos < e)).flatten()
        assert pos[rows].tolist() == [max(0, p) for p in range(e - compressed, e)]
        with torch.no_grad():
            want = d.head.adaptor(nxt[s:e].float())[:-1]
        torch.testing.assert_close(x[rows], want, atol=1e-5, rtol=1e-5)


def test_global_feature_reaches_every_later_text_entry_and_stops_at_the_next_image():
    """Two images apart (g1 then g2) and one clip of back-to-back frames (mean of their g): each text entry fuses
    the g of the latest media run before it, zeros before the first; decoding entries use the last one."""
    target = wrap(*tiny_llava(init=0.3))
    head = random_head(target)
    n, dim = 30, target.hidden_size
    gen = torch.Generator().manual_seed(0)
    nxt, feats = torch.randn(n, dim, generator=gen), torch.randn(n, dim, generator=gen)
    spans = [(3, 6), (10, 12), (18, 21), (21, 24)]  # image, image, then a clip of two frames
    assert media_runs_of(spans) == [[(3, 6)], [(10, 12)], [(18, 21), (21, 24)]]
    with torch.no_grad():
        x, pos, glob = head.sequence(nxt, feats, spans)
        g1, g2 = head.adaptor(nxt[3:6])[-1], head.adaptor(nxt[10:12])[-1]
        g3 = (head.adaptor(nxt[18:21])[-1] + head.adaptor(nxt[21:24])[-1]) / 2
        row = {int(p): i for i, p in enumerate(pos.tolist()) if not any(s <= p < e for s, e in spans)}
        for j, g in [(j, None) for j in range(3)] + [(j, g1) for j in range(6, 10)] + \
                [(j, g2) for j in range(12, 18)] + [(j, g3) for j in range(24, n)]:
            torch.testing.assert_close(x[row[j]], head.fuse(nxt[j], feats[j], g), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(head.fuse(nxt[7], feats[7], g1), head.fuse(nxt[7], feats[7], g2))
        torch.testing.assert_close(glob[0], g3)
        head.glob = glob  # what begin leaves for decoding: tree nodes and accepted tokens fuse the last run's g
        torch.testing.assert_close(head.inputs(nxt[None, :2], feats[None, :2], None)[0],
                                   head.fuse(nxt[:2], feats[:2], g3))
    assert head.sequence(nxt, feats, [])[2] is None  # text only: g = 0 everywhere


def test_img_fc_starts_as_identity_so_a_fresh_head_fuses_f_unchanged():
    target = wrap(*tiny_llava(init=0.3))
    head = ViSpecHead(ViSpecConfig.for_target(target))
    f, e, g = torch.randn(3, target.hidden_size), torch.randn(3, target.hidden_size), torch.randn(1, target.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(head.fuse(e, f, g), head.fc(torch.cat([e, f], -1)))
    assert head.adaptor.queries.shape == (2, head.cfg.num_heads, target.hidden_size // head.cfg.num_heads)


def _features(target, reqs, path, n_tokens=16):
    return load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=n_tokens), path))


def test_training_forward_computes_what_inference_drafts(tmp_path):
    """With noise 0, the training forward's prediction at an answer entry equals the drafter's after begin +
    observe on the same sequence (same compressed prefix, positions and global feature)."""
    target = wrap(*tiny_llava(init=0.3))
    req = Request(prompt="what is happening", images=tuple(random_images(2, seed=4)))
    ex = _features(target, [req], tmp_path / "f", n_tokens=12)[0]
    m = ViSpecMethod()
    head = m.head(target).float()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * 0.05)
    batch = m.collate([ex], [0], 0.0, torch.Generator())
    assert len(batch["spans"][0]) == 2
    with torch.no_grad():
        pred = vispec_forward(head, batch["emb"], batch["feat"], batch["valid"], batch["spans"])[0]
    d = ViSpecDrafter(head, target)
    n_p, ids, hid = ex.n_prompt, ex.input_ids.tolist(), ex.hidden.float()
    pre = TargetOutput(logits=torch.zeros(1, 1, 1), hidden=ex.hidden[None, :n_p].float(),
                       input_ids=ex.input_ids[None, :n_p], inputs_embeds=ex.embeds[None, :n_p].float(),
                       media_mask=ex.media[None, :n_p])  # no media_segments: the pieces come from the ids
    d.begin(target, pre, root=ids[n_p])
    torch.testing.assert_close(d.last[0], pred[n_p - 1], atol=1e-4, rtol=1e-4)
    j = n_p + 3
    d.observe(ids[n_p:j + 1], hid[n_p:j + 1], bonus=ids[j + 1])
    torch.testing.assert_close(d.last[0], pred[j], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_training_forward_computes_what_inference_drafts_on_a_clip(family):
    """A video clip on a family that cuts it by its own grid (Qwen2.5-VL: temporal groups; OneVision: frames):
    training's pieces are the stored features' segments, inference's the real prefill's `media_segments`; they are
    equal, and with noise 0 and features stored in float32 the training forward predicts at the prompt's end and at
    an answer entry what the drafter does after begin + observe."""
    torch.manual_seed(0)
    target = build_target(family)
    req = FAMILIES[family].requests["video"]
    ex = answer_and_featurize(target, req, DatagenRecipe(max_new_tokens=10, dtype="float32"))
    assert ex is not None and ex.segments is not None
    m = ViSpecMethod()
    head = m.head(target).float()
    with torch.no_grad():
        for p in head.parameters():  # img_fc's g half too, so the clip's pooled g moves every later prediction
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * 0.05)
    batch = m.collate([ex], [0], 0.0, torch.Generator())
    with torch.inference_mode():
        pre = target.prefill(target.encode(req))
    n_p, ids, hid = ex.n_prompt, ex.input_ids.tolist(), ex.hidden.float()
    assert pre.input_ids[0].tolist() == ids[:n_p]
    drafted = pieces_of(pre.media_segments[0])
    assert ex.pieces() == drafted and len(drafted) == {"qwen2_5_vl": 2, "llava_onevision": 4}[family]
    assert batch["spans"][0] == entry_spans(drafted)
    with torch.no_grad():
        pred = vispec_forward(head, batch["emb"], batch["feat"], batch["valid"], batch["spans"])[0]
    torch.testing.assert_close(pre.hidden[0], hid[:n_p], atol=1e-4, rtol=1e-4)  # float32 features: the same
    d = ViSpecDrafter(head, target)
    d.begin(target, pre, root=ids[n_p])
    assert d.prefill_tokens == n_p - sum(e - s for s, e in entry_spans(drafted)) + len(drafted)
    torch.testing.assert_close(d.last[0].float(), pred[n_p - 1], atol=1e-4, rtol=1e-4)
    j = min(n_p + 3, len(ids) - 2)
    d.observe(ids[n_p:j + 1], hid[n_p:j + 1], bonus=ids[j + 1])
    torch.testing.assert_close(d.last[0].float(), pred[j], atol=1e-4, rtol=1e-4)


def _objective_case(seed: int = 0):
    """(target's LM head W, a two-example batch with an image and a clip, a head with random weights)."""
    torch.manual_seed(seed)
    target = wrap(*tiny_llava(init=0.3))
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=2))),  # answers free of
            Request(prompt="what is happening", videos=(tuple(random_images(3, seed=54)),))]  # media placeholders
    exs = [answer_and_featurize(target, r, DatagenRecipe(max_new_tokens=8, dtype="float32")) for r in reqs]
    assert all(e is not None for e in exs)
    m = ViSpecMethod()
    head = m.head(target).float()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * 0.05)
    batch = m.collate(exs, [0, 1], 0.0, torch.Generator())
    return target.model.get_output_embeddings().weight.detach().float(), batch, head


def _passes(head, batch, n: int) -> list[torch.Tensor]:
    """The predictions of MTP passes 0..n-1 (pass m reads pass m-1's predicted features)."""
    feat, preds = batch["feat"], []
    for _ in range(n):
        preds.append(vispec_forward(head, batch["emb"], feat, batch["valid"], batch["spans"]))
        feat = torch.cat([feat[:, :1], preds[-1][:, :-1]], 1)
    return preds


def _by_hand(pred, batch, W, term) -> torch.Tensor:
    """Mean over the loss-masked entries of term(p_target, draft logits), one entry at a time."""
    vals = []
    for b, j in batch["loss_mask"].nonzero().tolist():
        vals.append(term(torch.softmax(batch["tgt"][b, j] @ W.T, -1), pred[b, j] @ W.T))
    return torch.stack(vals).mean()


def soft_ce(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return -(p * torch.log_softmax(s, -1)).sum()


def test_default_objective_is_the_papers_soft_ce_in_stage_2():
    """Stage 2 by default: the paper's Eq. 6, -sum_v p log p_draft per answer entry, averaged, mean over the two
    MTP passes, nothing else; stage 1 (text-only EAGLE pre-training) keeps EAGLE's loss."""
    W, batch, head = _objective_case()
    m = training_method("vispec")
    assert m.objective == "paper" and m.mtp_steps == 1 and OBJECTIVES == ("paper", "eagle", "l1_rank")
    with torch.no_grad():
        loss, parts = m.loss(head, batch, W, 0.1)
        preds = _passes(head, batch, 2)
        want = sum(_by_hand(p, batch, W, soft_ce) for p in preds) / 2
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
        assert parts["objective_paper"] == 1.0 and abs(parts["ploss"] - want.item()) < 1e-4
        assert loss.item() != pytest.approx(ViSpecMethod(objective="eagle").loss(head, batch, W, 0.1)[0].item())
        m.stage2 = False
        stage1, _ = m.loss(head, batch, W, 0.1)
        assert torch.equal(stage1, torch.zeros(()) + eagle_loss(preds[0], batch["tgt"], W, batch["loss_mask"])[0])


def test_eagle_objective_reproduces_eagles_loss_exactly():
    """objective=eagle: mean over the passes of smooth-L1 + p_weight x soft CE, bit for bit what ViSpec trained on
    before the objective was an option."""
    W, batch, head = _objective_case()
    m = ViSpecMethod(objective="eagle")
    with torch.no_grad():
        loss, parts = m.loss(head, batch, W, 0.1)
        want = torch.zeros(())
        for p in _passes(head, batch, 2):
            want = want + eagle_loss(p, batch["tgt"], W, batch["loss_mask"], p_weight=0.1)[0] / 2
    assert torch.equal(loss, want) and parts["objective_eagle"] == 1.0 and "vloss_pass1" in parts


def test_l1_rank_objective_is_the_authors_code_loss():
    """objective=l1_rank, stage 2: 10 x sum_v |p_draft - p| + 0.1 x the Plackett-Luce NLL of the target's top-10
    order; stage 1: smooth-L1 + 0.1 x (soft CE + 0.1 x that ranking), each per entry, averaged."""
    W, batch, head = _objective_case()
    m = ViSpecMethod(objective="l1_rank", mtp_steps=0)

    def rank(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        order = p.argsort(descending=True)[:10].tolist()
        return -sum(s[order[i]] - torch.logsumexp(s[order[i:]], 0) for i in range(10))

    def l1(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (torch.softmax(s, -1) - p).abs().sum()

    with torch.no_grad():
        pred = _passes(head, batch, 1)[0]
        loss, parts = m.loss(head, batch, W, 0.1)
        want = 10 * _by_hand(pred, batch, W, l1) + 0.1 * _by_hand(pred, batch, W, rank)
        torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-5)
        assert parts["objective_l1_rank"] == 1.0 and {"l1", "rank", "ploss", "vloss", "top1"} <= set(parts)
        m.stage2 = False
        vloss = eagle_loss(pred, batch["tgt"], W, batch["loss_mask"])[1]["vloss"]
        want1 = vloss + 0.1 * (_by_hand(pred, batch, W, soft_ce) + 0.1 * _by_hand(pred, batch, W, rank))
        torch.testing.assert_close(m.loss(head, batch, W, 0.1)[0], want1, atol=1e-4, rtol=1e-5)


def test_objective_option_from_the_command_line():
    """`--method-option objective=eagle` reaches the method and the head's config.json; an unknown one is refused."""
    target = wrap(*tiny_llava(init=0.3))
    opts = method_options(["objective=eagle", "mtp_steps=2"])
    assert opts == {"objective": "eagle", "mtp_steps": 2}
    m = training_method("vispec", opts)
    assert (m.objective, m.mtp_steps) == ("eagle", 2) and m.head(target).cfg.objective == "eagle"
    assert training_method("vispec", method_options(["objective=l1_rank"])).objective == "l1_rank"
    assert training_method("vispec").head(target).cfg.objective == "paper"
    with pytest.raises(ValueError, match="objective 'soft_ce'"):
        training_method("vispec", {"objective": "soft_ce"})


def test_vispec_training_lowers_the_loss_resumes_mtp_in_stage_2_only(tmp_path):
    """The default (paper) objective: the loss falls, a stopped run resumes, MTP in stage 2 only."""
    target = wrap(*tiny_llava(init=0.3))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(6)]
                   + [Request(prompt="what is happening", videos=(tuple(random_images(3, seed=50 + i)),))
                      for i in range(3)], tmp_path / "mm")
    text = _features(target, [Request(prompt=f"say something {i}") for i in range(9)], tmp_path / "text")
    cfg = TrainConfig(epochs=3, batch_size=3, lr=1e-2, warmup_steps=2, eval_max_new_tokens=8)
    m = training_method("vispec")
    assert stage_schedule(m, cfg.model_copy(update={"epochs": 6})).model_dump() == {
        "epochs": 6, "text_epochs": 2, "gradual": False, "mixed": False}  # a third text-only, then at once
    cfg = cfg.model_copy(update={"text_epochs": 2})  # the stop at 3 and the resumed run to 6 share the stages
    heldout = [Request(prompt="describe the image", images=tuple(random_images(1, seed=100)))]
    out = train_drafter("vispec", target, mm, tmp_path / "d", cfg, heldout=heldout, text_examples=text)
    out = train_drafter("vispec", target, mm, tmp_path / "d", cfg.model_copy(update={"epochs": 6}),
                        heldout=heldout, text_examples=text)
    hist = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in hist] == list(range(1, 7))
    assert [h["items"]["text"] > 0 for h in hist] == [True, True, False, False, False, False]
    assert ["vloss_pass1" in h for h in hist] == [False, False, True, True, True, True]  # MTP: stage 2 only
    assert all(h["objective_paper"] == 1.0 for h in hist)  # the run says which objective trained it
    assert json.loads((out / "config.json").read_text())["objective"] == "paper"
    W = target.model.get_output_embeddings().weight.detach().float()
    torch.manual_seed(cfg.seed)
    head0 = m.head(target).float()
    batch = m.collate(mm, list(range(len(mm))), 0.0, torch.Generator())
    with torch.no_grad():
        before = m.loss(head0, batch, W, 0.1)[0].item()
        after = m.loss(ViSpecHead.load(out).float(), batch, W, 0.1)[0].item()
    assert after < 0.9 * before, (before, after)
    assert json.loads((out / "config.json").read_text())["method"] == "vispec"
    assert isinstance(load_drafter(str(out), target), ViSpecDrafter)
    with pytest.raises(ValueError, match="holds a vispec training run, not eagle2"):
        train_drafter("eagle2", target, mm, tmp_path / "d", cfg.model_copy(update={"epochs": 9}))


def test_method_options_and_the_long_answer_rewrite():
    target = wrap(*tiny_llava(init=0.3))
    m = ViSpecMethod(compressed=4, mtp_steps=0)
    head = m.head(target)
    assert head.cfg.compressed == 4 and head.adaptor.queries.shape[0] == 5 and m.mtp_steps == 0
    assert ViSpecMethod().mtp_steps == 1 and ViSpecMethod.long_answers and ViSpecMethod.answer_temperature == 1.0
    img = {"id": 7, "media_type": "image", "prompt": "Is there a red star?", "task": "question"}
    vid = {"id": 8, "media_type": "video", "prompt": "What colour is it?", "task": "video_question"}
    assert at_length(img)["prompt"] in ("Describe the image in detail.", "Give a detailed description of this "
                                        "picture.") and at_length(img) == at_length(dict(img))
    assert at_length(vid)["prompt"] == "Describe the video in detail." and at_length(vid)["id"] == 8


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_vispec_is_lossless_on_every_family_and_request(family, tmp_path):
    """Briefly trained on the family's own media requests, and untrained: greedy spec == AR == HF generate on
    text, one image, two images and video (where the family takes video)."""
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    mm = _features(target, [r for n, r in reqs.items() if n != "text"] * 2, tmp_path / "mm", n_tokens=12)
    cfg = TrainConfig(epochs=8, batch_size=2, lr=1e-2, warmup_steps=1, text_epochs=0)  # stage 2 only (with MTP)
    out = train_drafter("vispec", target, mm, tmp_path / "d", cfg)
    top1 = check_learned(out)
    d = load_drafter(str(out), target)
    accepted = check_greedy_lossless(target, reqs, lambda: [("trained", d)], family)
    print(f"{family}: {accepted} drafts accepted")
    assert accepted > 0, (family, top1)  # drafts were accepted: the KV / position path after acceptance ran
    check_greedy_lossless(target, reqs, lambda: [("random", ViSpecDrafter.random(target, seed=3))], family)


def test_vispec_sampling_output_distribution_equals_the_target(tmp_path):
    """An image request at T 0.8, top-k 4, top-p 0.9 through a briefly trained ViSpec drafter: 3-token answers
    match the exact warped target distribution (chi-square at p = 1e-4, 1,500 samples)."""
    from test_engine import SAMPLED_FLOOR, check_trained_drafter_samples

    target = wrap(*tiny_llava(init=0.08))
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=7)))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(8)], tmp_path / "mm", n_tokens=8)
    cfg = TrainConfig(epochs=8, batch_size=4, lr=1e-2, warmup_steps=1, text_epochs=0)
    out = train_drafter("vispec", target, mm, tmp_path / "d", cfg)
    d = load_drafter(str(out), target)
    check_trained_drafter_samples(target, d, req, min_accepted=SAMPLED_FLOOR)
