"""Drafters for the toy world, trained by the same datagen + trainer users run on real targets; cached under the
toy world (`<world>/drafters/<method>`), rebuilt only when missing or forced."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from pydantic import BaseModel

from mmspec_ray.targets.registry import load_target
from mmspec_ray.toy.build import ToyWorld, build_toy
from mmspec_ray.toy.prompts import toy_requests
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features
from mmspec_ray.training.trainer import TrainConfig, train_eagle2

log = logging.getLogger(__name__)


class ToyDrafterRecipe(BaseModel):
    """How much target-answered data and training a toy drafter gets (per toy size)."""

    examples: int = 1200
    heldout: int = 12
    max_new_tokens: int = 200
    train: TrainConfig = TrainConfig(epochs=8, batch_size=16, lr=2e-3)


# toy-m: fewer prompts (each answer costs ~10x more target time than on toy-s); same training.
RECIPES = {"toy-s": ToyDrafterRecipe(), "toy-m": ToyDrafterRecipe(examples=800)}


def drafter_dir(world: ToyWorld, method: str) -> Path:
    return world.root / "drafters" / method


def train_drafter_on_world(world: ToyWorld, out: Path, method: str, recipe: ToyDrafterRecipe,
                           resume: bool = True) -> Path:
    """Datagen on the world's train split (the target answers), then training with held-out τ on validation."""
    if method != "eagle2":
        raise ValueError(f"training for drafter method {method!r} is not implemented yet; available: eagle2")
    target = load_target(world.target)
    feats = generate_features(target, toy_requests(world, "train", recipe.examples, seed=1),
                              DatagenRecipe(max_new_tokens=recipe.max_new_tokens), out / "features",
                              total=recipe.examples)
    heldout = list(toy_requests(world, "validation", recipe.heldout, seed=2))
    train_eagle2(target, load_features(feats), out, recipe.train, heldout=heldout, resume=resume)
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
