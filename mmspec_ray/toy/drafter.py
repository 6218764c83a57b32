"""Drafters for the toy world, trained by the same datagen + trainer users run on real targets; cached under the
toy world (`<world>/drafters/<method>`), rebuilt only when missing or forced.

The target-answered features live beside the drafters (`<world>/drafter-data/...`), named by what made them, so
every method trained on a world with the same recipe trains on the same examples (and they are generated once)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pydantic import BaseModel

from mmspec_ray.targets.registry import load_target
from mmspec_ray.toy.build import ToyWorld, build_toy
from mmspec_ray.toy.prompts import toy_long_requests, toy_requests, toy_text_requests
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features, refeaturize
from mmspec_ray.training.methods import TrainingMethod, training_method
from mmspec_ray.training.trainer import TrainConfig, stage_schedule, train_drafter

log = logging.getLogger(__name__)


class ToyDrafterRecipe(BaseModel):
    """How much target-answered data and training a toy drafter gets (per toy size)."""

    examples: int = 1200
    text_examples: int | None = None  # text-only prompts for a two-stage method's stage 1 (None: `examples`)
    heldout: int = 12
    max_new_tokens: int = 200
    # ViSpec's stage-2 data: the same prompts rewritten to ask for long answers (`prompts.at_length`), answered at
    # `answer_temperature`. None: the method's default (`TrainingMethod.long_answers` / `.answer_temperature`)
    long_answers: bool | None = None
    answer_temperature: float | None = None
    train: TrainConfig = TrainConfig(epochs=8, batch_size=16, lr=2e-3)


# toy-m: fewer prompts (each answer costs ~10x more target time than on toy-s); same training.
RECIPES = {"toy-s": ToyDrafterRecipe(), "toy-m": ToyDrafterRecipe(examples=800)}


def drafter_dir(world: ToyWorld, method: str) -> Path:
    return world.root / "drafters" / method


def toy_features(world: ToyWorld, target, recipe: ToyDrafterRecipe, text: bool = False, mid: bool = False) -> Path:
    """The world's target-answered features: multimodal train prompts, the text-only corpus (`text`), or the
    multimodal prompts rewritten to ask for long answers (`recipe.long_answers`, sampled at its temperature; a
    directory of its own, named by both). `mid`: the examples also carry DREAM's entropy-selected intermediate
    features (a directory of its own, suffix -mid; same prompts, same greedy answers)."""
    n = (recipe.text_examples or recipe.examples) if text else recipe.examples
    long = bool(recipe.long_answers) and not text
    temp = float(recipe.answer_temperature or 0.0) if long else 0.0
    kind = "text" if text else f"long-T{temp:g}" if long else "multimodal"
    out = world.root / "drafter-data" / f"{kind}-n{n}-t{recipe.max_new_tokens}{'-mid' if mid else ''}"
    if (out / "manifest.json").exists() or (out / "index.json").exists():
        return out
    reqs = (toy_text_requests(world, "train", n, seed=1) if text else
            toy_long_requests(world, "train", n, seed=1) if long else toy_requests(world, "train", n, seed=1))
    plain = out.with_name(out.name.removesuffix("-mid"))
    if mid and (plain / "manifest.json").exists():  # the same prompts answered already: reuse the answers
        return refeaturize(target, list(reqs), plain, DatagenRecipe(max_new_tokens=recipe.max_new_tokens,
                                                                    temperature=temp, mid_features=True), out)
    return generate_features(target, reqs, DatagenRecipe(max_new_tokens=recipe.max_new_tokens, temperature=temp,
                                                         mid_features=mid), out, total=n)


def train_drafter_on_world(world: ToyWorld, out: Path, method: "str | TrainingMethod", recipe: ToyDrafterRecipe,
                           resume: bool = True) -> Path:
    """Datagen on the world's train split (the target answers; the text-only corpus too when the method's
    schedule has a text stage), then training with held-out τ on validation."""
    m = training_method(method) if isinstance(method, str) else method
    recipe = recipe.model_copy(update={
        "long_answers": m.long_answers if recipe.long_answers is None else recipe.long_answers,
        "answer_temperature": m.answer_temperature if recipe.answer_temperature is None else recipe.answer_temperature})
    target = load_target(world.target)
    mid = "mid" in m.needs
    mm = load_features(toy_features(world, target, recipe, mid=mid))
    text = (load_features(toy_features(world, target, recipe, text=True, mid=mid))
            if stage_schedule(m, recipe.train).uses_text else [])
    heldout = list(toy_requests(world, "validation", recipe.heldout, seed=2))
    train_drafter(m, target, mm, out, recipe.train, heldout=heldout, resume=resume, text_examples=text)
    return out


def build_toy_drafter(name: str = "toy-s", method: str = "eagle2", force: bool = False) -> Path:
    """The trained drafter checkpoint for toy world `name` (trained on first use, a few minutes on a CPU)."""
    world = build_toy(name)
    out = drafter_dir(world, method)
    done = out / ".complete"
    if done.exists() and not force:
        return out
    if force and out.exists():
        shutil.rmtree(out)
    train_drafter_on_world(world, out, method, RECIPES[name])
    done.write_text("ok\n")
    return out
