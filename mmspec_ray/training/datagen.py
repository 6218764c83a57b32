"""Drafter training data: the target answers each prompt itself, then one teacher-forced target forward over
prompt + answer records its features (last post-norm hidden state) and input embeddings (media merged in).

Regenerating answers with the target (rather than using a data set's own answers) makes the drafter learn the
distribution it will actually be asked to predict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, Field
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from mmspec_ray.config import SamplingParams
from mmspec_ray.spec.engine import AREngine
from mmspec_ray.targets.base import Request, VLMTarget

log = logging.getLogger(__name__)


class DatagenRecipe(BaseModel):
    """How the target answers training prompts."""

    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0: greedy answers (what greedy serving will verify)")
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float16"  # storage dtype of features


@dataclass(frozen=True)
class FeatureExample:
    """One target-answered sequence. Position t of `hidden` is the target's feature after reading input_ids[:t+1]."""

    input_ids: torch.Tensor  # [L] long: prompt (media placeholders expanded) + the target's answer
    hidden: torch.Tensor  # [L, d] last post-norm hidden state (what lm_head consumes)
    embeds: torch.Tensor  # [L, d] input embeddings with media features merged
    n_prompt: int  # leading prompt positions (no loss on predicting them)
    media: torch.Tensor | None = None  # [L] bool: image/video token positions (None: features stored before it was)


def extend_inputs(inputs: dict, extra: list[int]) -> dict:
    """Append answer ids to encoded prompt inputs; other per-token tensors get 1 (attention_mask) or 0 (type ids)."""
    ids = inputs["input_ids"]
    L = ids.shape[1]
    add = torch.tensor([extra], dtype=ids.dtype, device=ids.device)
    out = dict(inputs)
    out["input_ids"] = torch.cat([ids, add], 1)
    for k, v in inputs.items():
        if k != "input_ids" and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == (1, L):
            fill = torch.ones_like(add) if k == "attention_mask" else torch.zeros_like(add)
            out[k] = torch.cat([v, fill.to(v.dtype)], 1)
    return out


@torch.inference_mode()
def answer_and_featurize(target: VLMTarget, request: Request, recipe: DatagenRecipe) -> FeatureExample | None:
    """None when the answer contains a media placeholder id (it could not be re-read without its media)."""
    sampling = SamplingParams(temperature=recipe.temperature, top_p=recipe.top_p, seed=recipe.seed)
    gen = AREngine(target).generate(request, sampling, max_new_tokens=recipe.max_new_tokens)
    if target.media_token_ids & set(gen.token_ids):
        return None
    inputs = target.encode(request)
    n_prompt = inputs["input_ids"].shape[1]
    out = target.prefill(extend_inputs(inputs, gen.token_ids))
    dt = getattr(torch, recipe.dtype)
    return FeatureExample(out.input_ids[0].cpu(), out.hidden[0].to(dt).cpu(), out.inputs_embeds[0].to(dt).cpu(),
                          n_prompt, out.media_mask[0].cpu())


def generate_features(target: VLMTarget, requests: Iterable[Request], recipe: DatagenRecipe, out_dir: str | Path,
                      total: int | None = None, shard_size: int = 256) -> Path:
    """Answer + featurize every request into safetensors shards under out_dir (index.json lists them).
    Resumable: finished shards are kept and their requests skipped."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = {p.name for p in out.glob("shard-*.safetensors")}
    shard: list[FeatureExample] = []
    current = ""
    skipped = 0
    for i, req in enumerate(tqdm(requests, total=total, desc="datagen (target answers)", unit="prompt")):
        name = f"shard-{i // shard_size:05d}.safetensors"
        if name != current and shard:
            _write_shard(out / current, shard)
            shard = []
        current = name
        if name not in done:
            ex = answer_and_featurize(target, req, recipe)
            if ex is None:
                skipped += 1
            else:
                shard.append(ex)
    if shard:
        _write_shard(out / current, shard)
    if skipped:
        log.warning("skipped %d answers that contained media placeholder tokens", skipped)
    (out / "index.json").write_text(json.dumps({"recipe": recipe.model_dump(),
                                                "shards": sorted(p.name for p in out.glob("shard-*.safetensors"))}))
    return out


def _write_shard(path: Path, examples: list[FeatureExample]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for j, ex in enumerate(examples):
        tensors[f"{j}.input_ids"] = ex.input_ids
        tensors[f"{j}.hidden"] = ex.hidden.contiguous()
        tensors[f"{j}.embeds"] = ex.embeds.contiguous()
        tensors[f"{j}.n_prompt"] = torch.tensor([ex.n_prompt])
        if ex.media is not None:
            tensors[f"{j}.media"] = ex.media.to(torch.uint8)
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.rename(path)


def load_features(out_dir: str | Path) -> list[FeatureExample]:
    out = Path(out_dir)
    if not (out / "index.json").exists():
        raise FileNotFoundError(f"{out} has no index.json; run data generation first")
    examples: list[FeatureExample] = []
    for name in json.loads((out / "index.json").read_text())["shards"]:
        t = load_file(str(out / name))
        n = len({k.split(".")[0] for k in t})
        examples += [FeatureExample(t[f"{j}.input_ids"], t[f"{j}.hidden"], t[f"{j}.embeds"],
                                    int(t[f"{j}.n_prompt"][0]),
                                    t[f"{j}.media"].bool() if f"{j}.media" in t else None) for j in range(n)]
    return examples
