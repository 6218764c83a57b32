"""Drafters for the toy world, trained by the same datagen + trainer users run on real targets; cached under the
toy world (`<world>/drafters/<method>`, with the recipe that made it), rebuilt when missing, made by another recipe,
or forced. Each world ships one drafter, the one measured fastest on it (`SHIPPED`): the drafter `auto` means there.

The target-answered features live beside the drafters (`<world>/drafter-data/...`), named by what made them, so
every method trained on a world with the same recipe trains on the same examples (and they are generated once)."""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel

from mmspec_ray.config import S3Config
from mmspec_ray.drafters.discover import DrafterChoice
from mmspec_ray.targets.registry import load_target
from mmspec_ray.toy.build import ToyWorld, build_toy
from mmspec_ray.toy.model import TOY_SIZES
from mmspec_ray.toy.prompts import toy_long_requests, toy_requests, toy_text_requests
from mmspec_ray.training.datagen import (DatagenRecipe, generate_features, lacks_attention, load_features,
                                         refeaturize, with_attention)
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


class ShippedDrafter(NamedTuple):
    """The drafter a toy world ships: a method trained on first use with `recipe`, or `draft-model:WORLD` (another
    toy world's target as draft model, no training); and why (docs/benchmarks.md)."""

    method: str
    recipe: ToyDrafterRecipe | None
    why: str
    first_use: str  # what its first use costs


# What `--drafter auto` (the default of the batch jobs, Serve and `mmspec generate`) means on each toy world.
SHIPPED = {
    # the suffix drafter over the target's answers to the 1,200 training prompts (~70 s of answering on 2 idle
    # cores, no training): faster than the trained EAGLE-2 on every toy-s workload, whose draft costs about as much
    # as a toy-s forward (docs/benchmarks.md, "The default drafter")
    "toy-s": ShippedDrafter("suffix", ToyDrafterRecipe(),
                            "suffix (the target's own answers as a token tree), the fastest drafter measured on toy-s",
                            "about 1.2 minutes on 2 cores: the target answers 1,200 prompts"),
    # toy-s as toy-m's draft model: toy-m was grown from toy-s, so the two agree for long runs; no training (the
    # trained HiViS head, the fastest trained drafter there, took tens of minutes on first use)
    "toy-m": ShippedDrafter("draft-model:toy-s", None, "toy-s as draft model, the fastest drafter measured on toy-m",
                            "nothing to train: toy-s is built with toy-m"),
}


def recipe_for(name: str, method: str) -> ToyDrafterRecipe:
    """The recipe a toy world trains `method` with: the shipped drafter's own, else the world's default."""
    shipped = SHIPPED.get(name)
    return shipped.recipe if shipped and shipped.method == method and shipped.recipe else RECIPES[name]


def drafter_dir(world: ToyWorld, method: str) -> Path:
    return world.root / "drafters" / method


def toy_features(world: ToyWorld, target, recipe: ToyDrafterRecipe, text: bool = False, mid: bool = False,
                 aux: bool = False) -> Path:
    """The world's target-answered features: multimodal train prompts, the text-only corpus (`text`), or the
    multimodal prompts rewritten to ask for long answers (`recipe.long_answers`, sampled at its temperature; a
    directory of its own, named by both). `mid`: the examples also carry DREAM's entropy-selected intermediate
    features and the prompts' attention (a directory of its own, suffix -mid; same prompts, same greedy answers; a
    -mid set stored without the attention, by a version before DREAM trained with visual token compression, is
    featurized again from its answers); `aux`: EAGLE-3's three feature layers (suffix -aux)."""
    n = (recipe.text_examples or recipe.examples) if text else recipe.examples
    long = bool(recipe.long_answers) and not text
    temp = float(recipe.answer_temperature or 0.0) if long else 0.0
    kind = "text" if text else f"long-T{temp:g}" if long else "multimodal"
    suffix = "-mid" if mid else "-aux" if aux else ""
    out = world.root / "drafter-data" / f"{kind}-n{n}-t{recipe.max_new_tokens}{suffix}"
    reqs = (toy_text_requests(world, "train", n, seed=1) if text else
            toy_long_requests(world, "train", n, seed=1) if long else toy_requests(world, "train", n, seed=1))
    data = DatagenRecipe(max_new_tokens=recipe.max_new_tokens, temperature=temp, mid_features=mid, aux_features=aux)
    if (out / "manifest.json").exists() or (out / "index.json").exists():
        if mid and lacks_attention(out):  # made before DREAM's training compressed visual tokens: made again
            return with_attention(target, list(reqs), out, data)
        return out
    plain = out.with_name(out.name.removesuffix(suffix)) if suffix else out
    if suffix and (plain / "manifest.json").exists():  # the same prompts answered already: reuse the answers
        return refeaturize(target, list(reqs), plain, data, out)
    return generate_features(target, reqs, data, out, total=n)


def train_drafter_on_world(world: ToyWorld, out: Path, method: "str | TrainingMethod", recipe: ToyDrafterRecipe,
                           resume: bool = True) -> Path:
    """Datagen on the world's train split (the target answers; the text-only corpus too when the method's
    schedule has a text stage), then training with held-out τ on validation."""
    m = training_method(method) if isinstance(method, str) else method
    recipe = recipe.model_copy(update={
        "long_answers": m.long_answers if recipe.long_answers is None else recipe.long_answers,
        "answer_temperature": m.answer_temperature if recipe.answer_temperature is None else recipe.answer_temperature})
    target = load_target(world.target)
    mid, aux = "mid" in m.needs, "aux" in m.needs
    mm = load_features(toy_features(world, target, recipe, mid=mid, aux=aux))
    text = (load_features(toy_features(world, target, recipe, text=True, mid=mid, aux=aux))
            if stage_schedule(m, recipe.train).uses_text else [])
    heldout = list(toy_requests(world, "validation", recipe.heldout, seed=2))
    train_drafter(m, target, mm, out, recipe.train, heldout=heldout, resume=resume, text_examples=text)
    return out


def build_toy_drafter(name: str = "toy-s", method: str = "eagle2", force: bool = False,
                      world: ToyWorld | None = None) -> Path:
    """The trained drafter checkpoint of `method` for toy world `name` (`world`: its built folder, else the default
    one), trained on first use with `recipe_for(name, method)`. One process trains; others wait for it."""
    world = world or build_toy(name)
    recipe = recipe_for(name, method)
    out = drafter_dir(world, method)
    done, made_by = out / ".complete", out / "recipe.json"
    want = recipe.model_dump(mode="json")
    revision = training_method(method).revision if not method.startswith("draft-model") else 1
    if revision > 1:  # a drafter trained by an earlier version of the method is trained again
        want["method_revision"] = revision

    def built() -> bool:
        return not force and done.exists() and made_by.exists() and json.loads(made_by.read_text()) == want

    if built():  # no lock needed (the world may sit on a read-only volume)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{method}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second job or replica waits here, then finds the drafter built
        if built():
            return out
        if out.exists():
            log.info("toy %s drafter %s: %s, training it again", name, out,
                     "forced" if force else "made by another recipe" if done.exists() else "unfinished")
            shutil.rmtree(out)
        how = ("its corpus is the answers: nothing to fit" if method == "suffix" else f"{recipe.train.epochs} epochs")
        log.info("building the %s drafter for %s on first use (%d prompts answered by the target; %s) into %s",
                 method, name, recipe.examples, how, out)
        t0 = time.time()
        train_drafter_on_world(world, out, method, recipe, resume=False)
        made_by.write_text(json.dumps(want, indent=2))
        done.write_text("ok\n")
        log.info("%s drafter for %s trained in %.0f s", method, name, time.time() - t0)
    return out


def toy_world_of(target: str) -> tuple[str, ToyWorld] | None:
    """(world name, world) when `target` names a toy world or is a built toy world's checkpoint folder, else None."""
    if target in TOY_SIZES:
        return (target, build_toy(target)) if target in SHIPPED else None
    if "://" in target:
        return None
    root = Path(target).expanduser().parent
    try:
        name = json.loads((root / "manifest.json").read_text()).get("name")
    except (OSError, ValueError):
        return None
    return (name, ToyWorld(root)) if name in SHIPPED and Path(target).expanduser().name == "target" else None


def choose_drafter(drafter: str | None, target: str, folders: tuple[str, ...] = (), data: str | None = None,
                   s3: S3Config | None = None, max_new_tokens: int | None = None) -> DrafterChoice:
    """`auto` (the default drafter) made concrete for `target`, with the reason: a toy world's shipped drafter (its
    checkpoint folder, trained on first use); else the drafter trained for this very checkpoint (its identity) with
    the best recorded held-out τ in $MMSPEC_HOME/drafters/ and `folders` (local or s3://); else `ngram`, saying so and
    naming the one command that trains a drafter on `data` (the job's input, answered up to the job's
    `max_new_tokens`). Anything else passes through."""
    from mmspec_ray.drafters.discover import choose_for, home_drafters, train_command
    from mmspec_ray.targets.layout import checkpoint_identity
    from mmspec_ray.targets.request import TargetError

    if drafter != "auto":
        return DrafterChoice(drafter, "given")
    world = toy_world_of(target)
    if world is not None:
        name, built = world
        shipped = SHIPPED[name]
        if shipped.method.startswith("draft-model:"):  # another toy world's target drafts
            sibling = shipped.method.partition(":")[2]
            log.info("drafter auto on %s: %s (%s)", name, shipped.why, shipped.first_use)
            return DrafterChoice(f"draft-model:{build_toy(sibling).target}", f"auto: {shipped.why}")
        log.info("drafter auto on %s: %s (its first use trains it: %s)", name, shipped.why, shipped.first_use)
        return DrafterChoice(str(build_toy_drafter(name, shipped.method, world=built)), f"auto: {shipped.why}")
    search = [home_drafters(), *folders]
    try:
        identity = checkpoint_identity(target, s3)
    except (TargetError, OSError, ValueError) as e:
        return DrafterChoice("ngram", f"auto: ngram (prompt lookup, about AR speed): the checkpoint's identity "
                             f"could not be read ({e}), so no trained drafter can be matched to it")
    best, seen, skipped = choose_for(identity, search, s3)
    for s in skipped:
        log.warning("drafter auto: skipped %s: %s", s.path, s.why)
    passed = "" if not skipped else f"; skipped {len(skipped)} that would not load: " + "; ".join(
        f"{s.path} ({s.why})" for s in skipped[:3]) + (" ..." if len(skipped) > 3 else "")
    if best is not None:
        tau = "no recorded held-out τ" if best.heldout_tau is None else f"held-out τ {best.heldout_tau:.2f}"
        return DrafterChoice(best.path, f"auto: {best.method} trained for this checkpoint ({identity}), the best of "
                             f"the drafters found for it by {tau}{passed}")
    return DrafterChoice("ngram", f"auto: ngram (prompt lookup, about AR speed): no drafter trained for this "
                         f"checkpoint ({identity}) among {seen} in {', '.join(search)}{passed}; train one on this "
                         f"data with: {train_command(target, data, max_new_tokens)}")


def resolve_auto_drafter(drafter: str | None, target: str, folders: tuple[str, ...] = (),
                         s3: S3Config | None = None) -> str | None:
    """`choose_drafter`'s spec alone (the reason goes to the log)."""
    choice = choose_drafter(drafter, target, folders, s3=s3)
    if drafter == "auto":
        log.info("drafter %s", choice.why)
    return choice.spec
