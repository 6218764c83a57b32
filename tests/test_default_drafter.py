"""The default drafter `auto`: a toy world's shipped drafter (trained on first use, once per recipe), ngram for any
other checkpoint; resolved by the batch jobs' plan, the decoder (Serve) and `mmspec generate`; calibration keys that
follow retrained weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmspec_ray.batch.cli import build_parser, plan
from mmspec_ray.batch.jobspec import DEFAULT_DRAFTER, DecodeConfig
from mmspec_ray.decoding.calibrate import calibration_key
from mmspec_ray.toy import drafter as toy_drafter
from mmspec_ray.toy.build import build_world
from mmspec_ray.toy.drafter import SHIPPED, ShippedDrafter, ToyDrafterRecipe, recipe_for, resolve_auto_drafter
from mmspec_ray.training.trainer import TrainConfig
from test_toy import MICRO

TINY_RECIPE = ToyDrafterRecipe(examples=6, heldout=2, max_new_tokens=8,
                               train=TrainConfig(epochs=1, batch_size=4, eval_max_new_tokens=8))


@pytest.fixture(scope="module")
def micro_world(tmp_path_factory):
    """A micro toy world with a short vision stage: what it answers does not matter here, only that it is one."""
    size = dataclasses.replace(MICRO, vision_steps=50)
    return build_world(size, seed=3, root=tmp_path_factory.mktemp("micro") / "toy-micro")


@pytest.fixture
def shipped_micro(monkeypatch):
    """The micro world ships an eagle2 drafter with a tiny recipe (the real toy worlds' recipes take minutes)."""
    monkeypatch.setitem(SHIPPED, MICRO.name, ShippedDrafter("eagle2", TINY_RECIPE, "test", "seconds"))
    return SHIPPED[MICRO.name]


def test_defaults_are_auto_and_toy_worlds_ship_their_fastest_drafter():
    assert DEFAULT_DRAFTER == "auto" and DecodeConfig(target="/m").drafter == "auto"
    assert build_parser("caption_kinetics").parse_args([]).drafter is None  # so the spec default (auto) applies
    assert SHIPPED["toy-s"].method == "suffix" and SHIPPED["toy-m"].method == "draft-model:toy-s"
    assert recipe_for("toy-s", "suffix") == SHIPPED["toy-s"].recipe
    assert recipe_for("toy-s", "msd") == toy_drafter.RECIPES["toy-s"]  # other methods keep the world's recipe


def test_a_shipped_suffix_drafter_is_the_worlds_answers(micro_world, monkeypatch):
    """A world shipping the suffix drafter builds it on first use through the same trainer: the target's answers to
    the recipe's prompts, no epochs, a held-out τ; `auto` then names it."""
    monkeypatch.setitem(SHIPPED, MICRO.name, ShippedDrafter("suffix", TINY_RECIPE, "test", "seconds"))
    out = Path(resolve_auto_drafter("auto", str(micro_world.target)))
    assert out == micro_world.root / "drafters" / "suffix"
    assert json.loads((out / "config.json").read_text())["method"] == "suffix"
    history = json.loads((out / "history.json").read_text())
    assert len(history) == 1 and history[0]["examples"] > 0 and "heldout_tau" in history[0]


def test_auto_is_ngram_for_checkpoints_and_other_names_pass_through(ckpt, tmp_path):
    assert resolve_auto_drafter("auto", ckpt) == "ngram"
    assert resolve_auto_drafter("auto", "s3://bucket/models/llava/") == "ngram"
    fake = tmp_path / "target"  # a folder named target whose parent is no toy world
    fake.mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "not-a-toy"}))
    assert resolve_auto_drafter("auto", str(fake)) == "ngram"
    for given in ("none", "ngram", "ngram:3", "/some/drafter", None):
        assert resolve_auto_drafter(given, ckpt) == given


def test_toy_world_trains_its_shipped_drafter_once_per_recipe(micro_world, shipped_micro, monkeypatch):
    out = Path(resolve_auto_drafter("auto", str(micro_world.target)))
    assert out == micro_world.root / "drafters" / "eagle2"
    assert json.loads((out / "config.json").read_text())["method"] == "eagle2"
    assert json.loads((out / "recipe.json").read_text()) == TINY_RECIPE.model_dump(mode="json")
    history = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in history] == [1] and "heldout_tau" in history[-1]
    stamp = (out / "model.safetensors").stat().st_mtime_ns

    assert resolve_auto_drafter("auto", str(micro_world.target)) == str(out)  # cached: not trained again
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp

    two = TINY_RECIPE.model_copy(update={"train": TINY_RECIPE.train.model_copy(update={"epochs": 2,
                                                                                        "eval_every": 5})})
    monkeypatch.setitem(SHIPPED, MICRO.name, shipped_micro._replace(recipe=two))
    assert resolve_auto_drafter("auto", str(micro_world.target)) == str(out)  # another recipe: trained again
    history = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2]
    assert "heldout_tau" not in history[0] and "heldout_tau" in history[1]  # eval_every 5: the last epoch only
    assert json.loads((out / "recipe.json").read_text())["train"]["epochs"] == 2

    from mmspec_ray.training.methods import TrainingMethod

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(TrainingMethod, "revision", 2)  # what the method trains changed: trained again
    assert resolve_auto_drafter("auto", str(micro_world.target)) == str(out)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    assert json.loads((out / "recipe.json").read_text())["method_revision"] == 2


def test_a_world_may_ship_another_worlds_target_as_its_draft_model(micro_world, monkeypatch):
    """toy-m ships toy-s as draft model: `auto` resolves to draft-model:<the sibling world's target>, trains
    nothing, and the spec loads as a draft-model drafter (here the micro world drafting for itself)."""
    from mmspec_ray.drafters.base import load_drafter
    from mmspec_ray.drafters.draft_model import DraftModelDrafter
    from mmspec_ray.targets import load_target

    monkeypatch.setitem(SHIPPED, MICRO.name, ShippedDrafter("draft-model:toy-sibling", None, "test", "nothing"))
    built = []
    monkeypatch.setattr(toy_drafter, "build_toy", lambda name, **kw: built.append(name) or micro_world)
    drafters = micro_world.root / "drafters"
    before = sorted(drafters.iterdir()) if drafters.exists() else []
    spec = resolve_auto_drafter("auto", str(micro_world.target))
    assert spec == f"draft-model:{micro_world.target}" and built == ["toy-sibling"]
    assert (sorted(drafters.iterdir()) if drafters.exists() else []) == before  # nothing trained
    assert isinstance(load_drafter(spec, load_target(micro_world.target)), DraftModelDrafter)


def test_job_plan_decoder_and_generate_resolve_auto(micro_world, shipped_micro, ckpt, monkeypatch):
    from mmspec_ray import cli
    from mmspec_ray.batch.decoder import SpecDecoder

    out = str(micro_world.root / "drafters" / "eagle2")
    spec, _, _ = plan("instruct", build_parser("instruct").parse_args(
        ["--target", str(micro_world.target), "--input", "/tmp/in.parquet"]))
    assert spec.decode.drafter == out and spec.output.endswith("instruct-toy-micro-eagle2")
    spec, _, _ = plan("instruct", build_parser("instruct").parse_args(["--target", ckpt, "--input", "/tmp/in.parquet"]))
    assert spec.decode.drafter == "ngram"
    spec, _, _ = plan("instruct", build_parser("instruct").parse_args(
        ["--target", str(micro_world.target), "--input", "/tmp/in.parquet", "--drafter", "none"]))
    assert spec.decode.drafter == "none"

    dec = SpecDecoder(DecodeConfig(target=str(micro_world.target), device="cpu", tree={"top_k": 2, "depth": 2,
                                                                                       "total_tokens": 4}))
    assert dec.config.drafter == out and type(dec.drafter).__name__ != "NgramDrafter"
    row = {"id": "r0", "prompt": "Describe the image.", "image_uri": str(next((micro_world.data / "images" /
                                                                              "test").iterdir()))}
    got = dec.decode(row)
    assert got["error"] is None and got["num_output_tokens"] > 0

    args = cli.build_parser().parse_args(["generate", "--target", ckpt, "--prompt", "hi"])
    assert args.drafter == "auto" and cli.resolve_drafter(args.drafter, ckpt) == "ngram"
    assert cli.resolve_drafter("auto", str(micro_world.target)) == out


def test_calibration_key_follows_retrained_weights(tmp_path):
    target = SimpleNamespace(model=SimpleNamespace(name_or_path=str(tmp_path / "t")), device=torch.device("cpu"),
                             dtype=torch.float32)
    d = tmp_path / "d"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 10)
    k1 = calibration_key(target, str(d))
    (d / "model.safetensors").write_bytes(b"y" * 12)
    k2 = calibration_key(target, str(d))
    assert k1["drafter"] == k2["drafter"] == str(d) and k1["drafter_weights"] != k2["drafter_weights"]
    assert "drafter_weights" not in calibration_key(target, "ngram")
    assert "target_weights" not in k1  # no weights in the target folder: the key is what it always was
