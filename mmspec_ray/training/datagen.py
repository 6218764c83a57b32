"""Drafter training data: the target answers each prompt itself, then one teacher-forced target forward over
prompt + answer records its features (last post-norm hidden state; EAGLE-3's three layers where asked), input
embeddings (media merged in) and media segments (each image / frame / temporal group, cut as the target cuts it when a drafter drafts).
DREAM's features add a prompt-only prefill for the last layer's attention (its visual token compression).

Regenerating answers with the target (rather than using a data set's own answers) makes the drafter learn the
distribution it will actually be asked to predict.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from pydantic import BaseModel, Field
from tqdm.auto import tqdm

from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.engine import AREngine
from mmspec_ray.drafters.eagle3 import default_feature_layers
from mmspec_ray.targets.base import Request, VLMTarget, extend_inputs
from mmspec_ray.training.dream import entropy_candidates, intermediate_features
from mmspec_ray.training.shards import FeatureExample, ShardStore

__all__ = ["DatagenRecipe", "FeatureExample", "answer_and_featurize", "featurize", "generate_features", "load_features",
           "refeaturize", "lacks_attention", "with_attention"]

# The error of a prompt whose answer holds a media placeholder id (it could not be re-read without its media).
MEDIA_IN_ANSWER = {"error": "answer: the target's answer contains a media placeholder token, which cannot be re-read "
                   "without its media", "error_kind": "invalid"}

log = logging.getLogger(__name__)


class DatagenRecipe(BaseModel):
    """How the target answers training prompts."""

    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0: greedy answers (what greedy serving will verify)")
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float16"  # storage dtype of features
    # DREAM: also each position's entropy-selected intermediate feature (`mid`) and, for a prompt with media, the
    # attention each prompt position receives in the target's last layer at prefill (`received`, for VTC)
    mid_features: bool = False
    aux_features: bool = False  # EAGLE-3: also the states at its three feature layers (`aux`)


@torch.inference_mode()
def answer_and_featurize(target: VLMTarget, request: Request, recipe: DatagenRecipe) -> FeatureExample | None:
    """None when the answer contains a media placeholder id (it could not be re-read without its media)."""
    sampling = SamplingParams(temperature=recipe.temperature, top_p=recipe.top_p, seed=recipe.seed)
    gen = AREngine(target).generate(request, sampling, max_new_tokens=recipe.max_new_tokens)
    if target.media_token_ids & set(gen.token_ids):
        return None
    return featurize(target, request, gen.token_ids, recipe)


@torch.inference_mode()
def featurize(target: VLMTarget, request: Request, answer: list[int], recipe: DatagenRecipe) -> FeatureExample:
    """One teacher-forced target forward over the prompt + `answer` (the target's own answer): the example."""
    inputs = target.encode(request)
    n_prompt = inputs["input_ids"].shape[1]
    received = prompt_attention(target, inputs) if recipe.mid_features else None
    n_layers = int(target.text_config.num_hidden_layers)
    layers = entropy_candidates(n_layers) if recipe.mid_features else ()
    aux_layers = default_feature_layers(n_layers) if recipe.aux_features else []
    kept = target.feature_layers
    target.feature_layers = tuple(sorted(set(kept) | set(aux_layers)))
    try:
        out = target.prefill(extend_inputs(inputs, list(answer)), entropy_layers=layers)
    finally:
        target.feature_layers = kept
    dt = getattr(torch, recipe.dtype)
    mid = None
    if layers:
        mid = intermediate_features({i: e[0] for i, e in out.attention_entropy.items()},
                                    {i: out.layers[i + 1][0] for i in layers})[0].to(dt).cpu()
    segments = None if out.media_segments is None else out.media_segments[0].to(torch.int32).cpu()
    # un-normed residual-stream states can exceed float16's range on large targets: stored in bfloat16
    aux = torch.cat([out.layers[k][0] for k in aux_layers], -1).to(torch.bfloat16).cpu() if aux_layers else None
    positions = None if out.positions is None else out.positions[:, 0].to(torch.int32).cpu()
    return FeatureExample(out.input_ids[0].cpu(), out.hidden[0].to(dt).cpu(), out.inputs_embeds[0].to(dt).cpu(),
                          n_prompt, out.media_mask[0].cpu(), mid, segments, aux, positions, received)


def prompt_attention(target: VLMTarget, inputs: dict) -> torch.Tensor | None:
    """[n_prompt] float32: the attention each prompt position receives in the target's last layer at prefill, from
    exactly the prefill the engine runs when DREAM drafts (`prefill(attention=True)` on the prompt alone), so
    training ranks the visual tokens as drafting will (VTC); None for a prompt without media (nothing to cut)."""
    if not bool(target.media_mask_of(inputs["input_ids"]).any()):
        return None
    return target.prefill(inputs, attention=True).attention_received[0].float().cpu()


def generate_features(target: VLMTarget, requests: Iterable[Request], recipe: DatagenRecipe, out_dir: str | Path,
                      total: int | None = None, shard_size: int = 256) -> Path:
    """Answer + featurize every request in this process into shards under out_dir (the format of
    `training/shards.py`, the one the Ray Data job writes too). Resumable: finished shards are kept and their
    requests skipped. Rows are identified by their position in `requests`."""
    store = ShardStore(str(out_dir))
    done = set(store.shard_names())
    shard: list[FeatureExample] = []
    ids: list[str] = []
    errors: dict[str, dict[str, str]] = {}
    current = ""
    for i, req in enumerate(tqdm(requests, total=total, desc="datagen (target answers)", unit="prompt")):
        name = f"shard-{i // shard_size:05d}.safetensors"
        if name != current and ids:
            store.write_shard(current, shard, ids, errors)
            shard, ids, errors = [], [], {}
        current = name
        if name in done:
            continue
        ids.append(str(i))
        ex = answer_and_featurize(target, req, recipe)
        if ex is None:
            errors[str(i)] = dict(MEDIA_IN_ANSWER)
        else:
            shard.append(ex)
    if ids:
        store.write_shard(current, shard, ids, errors)
    manifest = store.write_manifest({"recipe": recipe.model_dump(), "writer": "in-process"})
    if manifest["errors"]:
        log.warning("%d prompts gave no example (answers containing media placeholder tokens)",
                    len(manifest["errors"]))
    return Path(out_dir)


def refeaturize(target: VLMTarget, requests: list[Request], source: str | Path, recipe: DatagenRecipe,
                out_dir: str | Path) -> Path:
    """The examples of `source` (generated from these `requests`, rows by position) featurized again with
    `recipe`'s feature set, reusing their stored answers: one forward per example instead of answering again (the
    answers are the target's own either way). The prompt ids must match, else the sources differ: refused."""
    src = ShardStore(str(source))
    store = ShardStore(str(out_dir))
    for name in src.manifest()["shards"]:
        info = src.shard_info(name)
        rows = [r for r in info.ids if r not in info.errors]
        examples = []
        for row, ex in zip(rows, tqdm(src.load_shard(name), desc=f"refeaturize {name}", unit="example")):
            new = featurize(target, requests[int(row)], ex.input_ids[ex.n_prompt:].tolist(), recipe)
            if not torch.equal(new.input_ids, ex.input_ids):
                raise ValueError(f"{source}: row {row} was not made from this request (prompt ids differ)")
            examples.append(new)
        store.write_shard(name, examples, info.ids, info.errors)
    store.write_manifest({"recipe": recipe.model_dump(), "writer": "in-process", "answers_from": str(source)})
    return Path(out_dir)


def lacks_attention(uri: str | Path) -> bool:
    """Whether a feature set holds examples with media but no prompt attention (`received`): DREAM features made
    before its training compressed visual tokens as drafting does. Reads the shards' headers only."""
    store = ShardStore(str(uri))
    return any(info.multimodal and "received" not in info.fields
               for info in (store.shard_info(n) for n in store.manifest()["shards"]))


def with_attention(target: VLMTarget, requests: list[Request], folder: str | Path, recipe: DatagenRecipe) -> Path:
    """A DREAM feature set (`recipe.mid_features`) made from `requests` whose media examples carry `received`:
    `folder` as it is, or, where it was stored without it, featurized again from its own answers (`refeaturize`,
    one forward per example; the folder is replaced once the new set is complete)."""
    folder = Path(folder)
    if not recipe.mid_features or not lacks_attention(folder):
        return folder
    log.info("%s: examples with media stored without the prompt's attention (made before DREAM trained with visual "
             "token compression); featurizing them again from their stored answers", folder)
    fresh = folder.with_name(folder.name + ".fresh")
    shutil.rmtree(fresh, ignore_errors=True)
    refeaturize(target, requests, folder, recipe, fresh)
    shutil.rmtree(folder)
    fresh.rename(folder)
    return folder


def load_features(uri: str | Path) -> list[FeatureExample]:
    """Every example of a shard directory (local or s3://)."""
    return ShardStore(str(uri)).load_all()
