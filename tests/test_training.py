"""Drafter training end to end on a tiny target: target-answered datagen, EAGLE losses, checkpoints that load
through `load_drafter`, resume, and the first law with the trained drafter."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features
from mmspec_ray.training.methods import ViSpecMethod
from mmspec_ray.training.trainer import TrainConfig, check_resume_config, train_drafter
from tiny import random_images, tiny_llava


@pytest.fixture(scope="module")
def target():
    return wrap(*tiny_llava(init=0.3))


def reqs(n: int, offset: int = 0) -> list[Request]:
    return [Request(prompt="describe the image", images=tuple(random_images(1, seed=offset + i))) for i in range(n)]


def test_datagen_stores_the_targets_own_answers_and_features(target, tmp_path):
    out = generate_features(target, reqs(5), DatagenRecipe(max_new_tokens=10), tmp_path / "f", shard_size=2)
    ex = load_features(out)
    assert 3 <= len(ex) <= 5  # answers that contain media placeholder ids are skipped (logged)
    assert sorted(p.name for p in out.glob("shard-*.safetensors")) == ["shard-00000.safetensors",
                                                                      "shard-00001.safetensors",
                                                                      "shard-00002.safetensors"]
    answers = [(r, AREngine(target).generate(r, max_new_tokens=10).token_ids) for r in reqs(5)]
    kept = [(r, a) for r, a in answers if not set(a) & target.media_token_ids]
    assert [e.input_ids[e.n_prompt:].tolist() for e in ex] == [a for _, a in kept]  # the target's own answers
    e, first = ex[0], kept[0][0]
    with torch.inference_mode():
        full = target.prefill({**target.encode(first), "input_ids": e.input_ids[None],
                               "attention_mask": torch.ones_like(e.input_ids)[None]})
    assert torch.allclose(e.hidden.float(), full.hidden[0].float(), atol=2e-2 * full.hidden.abs().max().item())
    assert e.embeds.shape == e.hidden.shape


def test_training_lowers_the_loss_checkpoints_resume_and_stay_lossless(target, tmp_path):
    feats = load_features(generate_features(target, reqs(16), DatagenRecipe(max_new_tokens=16), tmp_path / "f"))
    cfg = TrainConfig(epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, eval_max_new_tokens=8)
    out = train_drafter("eagle2", target, feats, tmp_path / "d", cfg, heldout=reqs(2, offset=100))
    hist = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in hist] == [1, 2] and all(0 <= h["heldout_tau"] <= TreeConfig().depth for h in hist)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    # resume: asking for 4 epochs continues from epoch 2
    out = train_drafter("eagle2", target, feats, tmp_path / "d", cfg.model_copy(update={"epochs": 4}),
                        heldout=reqs(2, 100))
    hist = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4]
    assert hist[-1]["loss"] < hist[0]["loss"]
    d = load_drafter(str(out), target)
    assert isinstance(d, Eagle2Drafter)
    # the recorded held-out τ is the saved drafter's real τ on those prompts (default tree, eval length)
    eng = SpecEngine(target, d, TreeConfig())
    stats = [eng.generate(r, max_new_tokens=cfg.eval_max_new_tokens).stats for r in reqs(2, offset=100)]
    tau = sum(sum(st.accepted_per_cycle) for st in stats) / sum(st.cycles for st in stats)
    assert hist[-1]["heldout_tau"] == pytest.approx(tau) and 0 <= tau <= TreeConfig().depth
    for r in reqs(3, offset=200):
        ar = AREngine(target).generate(r, max_new_tokens=24)
        sp = SpecEngine(target, d, TreeConfig(top_k=4, depth=3, total_tokens=12)).generate(r, max_new_tokens=24)
        assert sp.token_ids == ar.token_ids


def test_resume_refuses_another_head_config_and_continues_the_same(target, tmp_path):
    """A stopped run resumes only with the head config it was trained with: another option (or a default changed
    since) is refused, naming the field; a ViSpec run saved before its objective was recorded trained with eagle."""
    feats = load_features(generate_features(target, reqs(6), DatagenRecipe(max_new_tokens=8), tmp_path / "f"))
    cfg = TrainConfig(epochs=1, text_epochs=0, batch_size=3, lr=3e-3, warmup_steps=1, eval_every=100)
    out = tmp_path / "d"
    train_drafter(ViSpecMethod(objective="eagle"), target, feats, out, cfg)
    more = cfg.model_copy(update={"epochs": 2})
    with pytest.raises(ValueError, match=r"objective 'eagle' \(saved\) vs 'paper' \(now\).*--force starts over"):
        train_drafter(ViSpecMethod(), target, feats, out, more)
    with pytest.raises(ValueError, match=r"compressed 1 \(saved\) vs 4 \(now\)"):
        train_drafter(ViSpecMethod(compressed=4, objective="eagle"), target, feats, out, more)
    assert [h["epoch"] for h in json.loads((out / "history.json").read_text())] == [1]  # nothing trained
    # a run checkpointed before the state recorded the config, by a version that saved no objective: eagle's
    state = torch.load(out / "trainer_state.pt", weights_only=False)
    del state["config"]
    torch.save(state, out / "trainer_state.pt")
    saved = json.loads((out / "config.json").read_text())
    del saved["objective"]
    (out / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"objective 'eagle' \(saved\) vs 'paper'"):
        train_drafter(ViSpecMethod(), target, feats, out, more)
    train_drafter(ViSpecMethod(objective="eagle"), target, feats, out, more)
    assert [h["epoch"] for h in json.loads((out / "history.json").read_text())] == [1, 2]
    assert torch.load(out / "trainer_state.pt", weights_only=False)["config"]["objective"] == "eagle"
    train_drafter(ViSpecMethod(), target, feats, out, cfg, resume=False)  # starting over takes the new options
    assert json.loads((out / "config.json").read_text())["objective"] == "paper"
    # a field saved before it existed reads as the head would load it (ViSpec's media_norm: off)
    old = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k != "media_norm"}
    with pytest.raises(ValueError, match=r"media_norm False \(saved\) vs True \(now\)"):
        check_resume_config("vispec", old, ViSpecMethod().head(target), out)


def test_load_drafter_errors_are_clear(target, tmp_path):
    with pytest.raises(ValueError, match="neither a method name"):
        load_drafter(str(tmp_path / "nope"), target)
    other = wrap(*tiny_llava(init=0.3))
    Eagle2Drafter.random(other).head.save(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg["hidden_size"] = 999
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trained for another target: .*hidden size / vocab 999 / .* vs 64 /"):
        load_drafter(str(tmp_path / "ok"), target)  # the config is checked before any weight is read
    cfg["hidden_size"] = target.hidden_size
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    assert isinstance(load_drafter(str(tmp_path / "ok"), target, device="cpu"), Eagle2Drafter)
    with pytest.raises(ValueError, match="drafter device meta differs from the target's device cpu"):
        load_drafter(str(tmp_path / "ok"), target, device="meta")  # was accepted and ignored


def test_random_drafter_depends_only_on_its_seed(target):
    """Every parameter of `Eagle2Drafter.random(seed=...)` comes from the seed, none from the global RNG."""
    torch.manual_seed(1)
    a = Eagle2Drafter.random(target, seed=7).head.state_dict()
    torch.manual_seed(2)
    b = Eagle2Drafter.random(target, seed=7).head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = Eagle2Drafter.random(target, seed=8).head.state_dict()
    assert not torch.equal(a["fc.bias"], c["fc.bias"]) and not torch.equal(a["fc.weight"], c["fc.weight"])
