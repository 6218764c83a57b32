"""MSD: media entries take the target's projected embeddings untouched and text entries the fused input,
at every image/video boundary of every family; the two-stage schedule gives the spec's proportions; training
lowers the loss and resumes; a briefly trained MSD drafter stays lossless on every family and every request."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.layers import rms_normalise
from mmspec_ray.drafters.msd import MSDConfig, MSDDrafter, MSDHead
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features
from mmspec_ray.training.methods import training_method
from mmspec_ray.training.schedule import StageSchedule
from mmspec_ray.training.trainer import TrainConfig, train_drafter
from families import FAMILIES, build_target
from test_engine import check_greedy_lossless, check_learned
from tiny import random_images, tiny_llava

TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)


def captured_inputs(drafter, target, req: Request) -> tuple[torch.Tensor, ...]:
    """(decoder-layer input [L, d], inputs_embeds [L, d], hidden [L, d], media mask [L]) of `begin` on `req`."""
    seen = []
    hook = drafter.head.layer.register_forward_hook(lambda mod, args, out: seen.append(args[0][0].clone()))
    pre = target.prefill(target.encode(req))
    try:
        drafter.begin(target, pre, root=5)
    finally:
        hook.remove()
    return seen[0], pre.inputs_embeds[0], pre.hidden[0], pre.media_mask[0]


@pytest.mark.parametrize("family,request_name", [(f, r) for f, fam in FAMILIES.items() for r in fam.requests])
@pytest.mark.parametrize("media_norm", [True, False], ids=["normalised", "untouched"])
def test_media_entries_take_the_projected_embeddings_untouched(family, request_name, media_norm):
    """Media entries take the projected embeddings with no fc and no feature: RMS-normalised (a new head) or bit
    for bit (a config saved before `media_norm` existed loads as False)."""
    torch.manual_seed(0)
    target = build_target(family)
    drafter = MSDDrafter.random(target, seed=3)
    assert drafter.head.cfg.media_norm and not MSDConfig.model_validate(
        drafter.head.cfg.model_dump(exclude={"media_norm"})).media_norm
    drafter.head.cfg = drafter.head.cfg.model_copy(update={"media_norm": media_norm})
    x, emb, hid, media = captured_inputs(drafter, target, FAMILIES[family].requests[request_name])
    visual = torch.cat([media[1:], media.new_zeros(1)])  # entry j: token j+1 is a media token
    assert int(visual.sum()) == int(media.sum()) == (0 if request_name == "text" else int(media.sum()))
    if request_name != "text":
        assert media.any()
        raw = emb[1:][visual[:-1]]
        assert torch.equal(x[visual], rms_normalise(raw) if media_norm else raw)  # bit for bit: no fc, no feature
        if media_norm:
            ms = x[visual].pow(2).mean(-1)  # unit mean square, to float32 rounding of rows ~200x the text's size
            torch.testing.assert_close(ms, torch.ones_like(ms), rtol=1e-3, atol=0)
    nxt = torch.cat([emb[1:], target.embed_tokens(torch.tensor([5]))], 0)
    with torch.no_grad():
        fused = drafter.head.fc(torch.cat([nxt, hid], -1))
    torch.testing.assert_close(x[~visual], fused[~visual])
    # the boundary rule (spec §2.3): for a span [p, p+n), entries p-1 .. p+n-2 take v_0 .. v_{n-1}; entry p+n-1
    # (the last media token's feature with the next text token) is fused
    starts = torch.nonzero(media[1:] & ~media[:-1]).flatten() + 1
    ends = torch.nonzero(media[:-1] & ~media[1:]).flatten() + 1
    for p, e in zip(starts.tolist(), ends.tolist()):
        norm = rms_normalise if media_norm else (lambda t: t)
        assert torch.equal(x[p - 1], norm(emb[p])) and torch.equal(x[e - 2], norm(emb[e - 1]))
        torch.testing.assert_close(x[e - 1], fused[e - 1])


def test_eagle2_fuses_every_entry_on_the_same_weights():
    """The decoupling is the only difference: an eagle2 head with MSD's weights fuses media entries too."""
    from mmspec_ray.drafters.eagle import Eagle2Drafter, Eagle2Head

    target = wrap(*tiny_llava(init=0.3))
    msd = MSDDrafter.random(target, seed=1)
    eagle_head = Eagle2Head(msd.head.cfg)
    eagle_head.load_state_dict(msd.head.state_dict())
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=4)))
    xm, emb, hid, media = captured_inputs(msd, target, req)
    xe, *_ = captured_inputs(Eagle2Drafter(eagle_head, target), target, req)
    visual = torch.cat([media[1:], media.new_zeros(1)])
    assert torch.equal(xm[~visual], xe[~visual]) and not torch.allclose(xm[visual], xe[visual])


def test_mixing_schedule_gives_the_spec_proportions_at_its_boundaries():
    s = StageSchedule(epochs=40, text_epochs=20)  # the authors' run: 20 text-only epochs, then 20 ramping
    assert [s.ratio(e) for e in (1, 20)] == [0.0, 0.0]
    assert s.ratio(21) == pytest.approx(0.05) and s.ratio(30) == pytest.approx(0.5)
    assert s.ratio(39) == pytest.approx(0.95) and s.ratio(40) == 1.0
    assert StageSchedule(epochs=40, text_epochs=20, gradual=False).ratio(21) == 1.0
    assert all(StageSchedule(epochs=8).ratio(e) == 1.0 for e in range(1, 9))  # one stage: all multimodal
    toy = StageSchedule(epochs=8, text_epochs=training_method("msd").default_text_epochs(8))
    assert [toy.ratio(e) for e in range(1, 9)] == [0, 0, 0, 0, 0.25, 0.5, 0.75, 1.0]
    rng = np.random.default_rng(0)
    for e, r in ((4, 0.0), (5, 0.25), (6, 0.5), (7, 0.75), (8, 1.0)):
        items = toy.items(e, 4000, 3000, rng)
        assert len(items) == 3000  # min(N_text, N_multimodal) items per epoch
        share = sum(mm for mm, _ in items) / len(items)
        assert abs(share - r) < 0.03, (e, share)
        assert len({i for mm, i in items if mm}) == sum(mm for mm, _ in items)  # no repeats within a pool
    assert [mm for mm, _ in StageSchedule(epochs=2).items(1, 5, 0, rng)] == [True] * 5
    with pytest.raises(ValueError, match="needs text and multimodal examples"):
        toy.items(5, 10, 0, rng)
    with pytest.raises(ValueError, match="must be below epochs"):
        StageSchedule(epochs=4, text_epochs=4)


def _features(target, reqs, path, n_tokens=16):
    return load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=n_tokens), path))


def test_msd_training_lowers_the_loss_resumes_and_stays_lossless(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(12)], tmp_path / "mm")
    text = _features(target, [Request(prompt=f"describe {w} the image") for w in
                              ("a", "one", "what", "is", "the", "this", "big", "red", "an", "two", "it", "there")],
                     tmp_path / "text")
    assert all(e.media.any() for e in mm) and not any(e.media.any() for e in text)
    cfg = TrainConfig(epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, eval_max_new_tokens=8)
    heldout = [Request(prompt="describe the image", images=tuple(random_images(1, seed=100)))]
    out = train_drafter("msd", target, mm, tmp_path / "d", cfg, heldout=heldout, text_examples=text)
    hist = json.loads((out / "history.json").read_text())
    assert [h["multimodal_share"] for h in hist] == [0.0, 1.0]  # 2 epochs: 1 text-only, then all multimodal
    assert hist[0]["items"] == {"multimodal": 0, "text": min(len(mm), len(text))}  # min(N_text, N_mm) per epoch
    out = train_drafter("msd", target, mm, tmp_path / "d", cfg.model_copy(update={"epochs": 4, "text_epochs": 1}),
                        heldout=heldout, text_examples=text)
    hist = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4]
    m, W = training_method("msd"), target.model.get_output_embeddings().weight.detach().float()
    batch = m.collate(mm, list(range(len(mm))), 0.0, torch.Generator())
    torch.manual_seed(cfg.seed)  # the trainer's initial head
    with torch.no_grad():
        before = m.loss(m.head(target).float(), batch, W, 0.1)[0].item()
        after = m.loss(MSDHead.load(out).float(), batch, W, 0.1)[0].item()
    assert after < before, (before, after)  # on the multimodal examples (epochs mix text and media)
    assert [h["multimodal_share"] for h in hist[2:]] == [pytest.approx(2 / 3), 1.0]
    assert json.loads((out / "config.json").read_text())["method"] == "msd"
    d = load_drafter(str(out), target)
    assert isinstance(d, MSDDrafter) and isinstance(d.head, MSDHead)
    with pytest.raises(ValueError, match="holds a msd training run, not eagle2"):
        train_drafter("eagle2", target, mm, tmp_path / "d", cfg.model_copy(update={"epochs": 5}))
    for i in range(3):
        req = Request(prompt="describe the image", images=tuple(random_images(1, seed=200 + i)))
        assert SpecEngine(target, d, TREE).generate(req, max_new_tokens=24).token_ids == \
            AREngine(target).generate(req, max_new_tokens=24).token_ids


def test_msd_training_refuses_features_without_a_media_mask(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    ex = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=1)))],
                   tmp_path / "f", n_tokens=4)
    old = [type(ex[0])(ex[0].input_ids, ex[0].hidden, ex[0].embeds, ex[0].n_prompt)]  # stored before media masks
    with pytest.raises(ValueError, match=r"msd training needs \['media'\]"):
        train_drafter("msd", target, old, tmp_path / "d", TrainConfig(epochs=1, text_epochs=0))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_msd_is_lossless_on_every_family_and_request(family, tmp_path):
    """Briefly trained on the family's own media requests (the multimodal stage alone: a short two-stage run ends
    on the text -> multimodal ramp with a top-1 near zero; the stages are tested above); greedy spec == AR == HF
    generate on each."""
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    media = [r for n, r in reqs.items() if n != "text"]
    mm = _features(target, media * 2, tmp_path / "mm", n_tokens=12)
    cfg = TrainConfig(epochs=8, batch_size=2, lr=3e-3, warmup_steps=1, text_epochs=0)
    out = train_drafter("msd", target, mm, tmp_path / "d", cfg)
    top1 = check_learned(out)
    d = load_drafter(str(out), target)
    accepted = check_greedy_lossless(target, reqs, lambda: [("trained", d)], family)
    print(f"{family}: {accepted} drafts accepted")
    assert accepted > 0, (family, top1)  # drafts were accepted: the drafter's KV path after acceptance ran


def test_msd_sampling_output_distribution_equals_the_target(tmp_path):
    """An image request at T 0.8, top-k 4, top-p 0.9 through a briefly trained MSD drafter: 3-token answers match
    the exact warped target distribution (chi-square at p = 1e-4, 1,500 samples)."""
    from test_engine import SAMPLED_FLOOR, check_trained_drafter_samples

    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=7)))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(8)], tmp_path / "mm", n_tokens=8)
    cfg = TrainConfig(epochs=8, batch_size=4, lr=3e-3, warmup_steps=1, text_epochs=0)
    out = train_drafter("msd", target, mm, tmp_path / "d", cfg)
    d = load_drafter(str(out), target)
    check_trained_drafter_samples(target, d, req, min_accepted=SAMPLED_FLOOR)


def test_bench_runs_several_drafters_in_one_interleaved_run(tmp_path):
    """`mmspec bench --drafter eagle2,msd,LABEL=DIR`: every drafter runs on every prompt beside AR, and is summarised
    with its τ and its draft / verify time per cycle."""
    from mmspec_ray.bench.run import BenchConfig, run_bench, to_markdown
    from mmspec_ray.cli import UsageError, bench_drafters
    from mmspec_ray.drafters.eagle import Eagle2Drafter

    assert bench_drafters("eagle2,msd,abl=/x/ckpt,/y/msd-2") == {"eagle2": "eagle2", "msd": "msd", "abl": "/x/ckpt",
                                                                "msd-2": "/y/msd-2"}
    assert bench_drafters("") == {}
    for bad in ("eagle2,eagle2", "oracle=/x"):
        with pytest.raises(UsageError, match="is taken"):
            bench_drafters(bad)
    target = wrap(*tiny_llava(init=0.3))
    Eagle2Drafter.random(target, seed=1).head.save(tmp_path / "e")
    MSDDrafter.random(target, seed=1).head.save(tmp_path / "m")
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=3)))
    cfg = BenchConfig(prompts=1, max_new_tokens=8, repeats=1, temperatures=(0.0,), tree=TreeConfig(top_k=2, depth=2,
                                                                                                  total_tokens=6))
    res = run_bench(target, [req], {"eagle2": str(tmp_path / "e"), "msd": str(tmp_path / "m")}, cfg)
    rows = res["summary"]["0.0"]
    assert {"ar", "eagle2", "msd"} <= set(rows)
    assert all(rows[m]["draft_ms_per_cycle"] > 0 and rows[m]["verify_ms_per_cycle"] > 0 for m in ("eagle2", "msd"))
    assert all(0 < rows[m]["drafter_prefill_ms"] for m in ("eagle2", "msd"))  # the drafter's begin, per request
    assert "| msd |" in to_markdown(res, "tiny") and "draft ms/cycle" in to_markdown(res, "tiny")
