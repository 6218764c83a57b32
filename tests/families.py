"""The one registry of target families the tests run: per family, its tiny builder, its standard requests, and the
parameters of the family-independent contract checks (tests/target_checks.py, run by tests/test_target_contract.py).

Family test modules take their `target` and `REQUESTS` from here; test_engine builds its targets from here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from mmspec_ray.targets import Request, wrap
from mmspec_ray.targets.base import VLMTarget
from tiny import random_image, random_images

TEXT = Request(prompt="describe the image")


def _lazy(module: str, fn: str) -> Callable[..., tuple]:
    """Builder that imports tests/<module>.py on first call: a family whose builder module is absent fails the test
    that needs it (with the file it wanted), instead of breaking collection of every module importing this one."""

    def build(*args, **kwargs):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            pytest.fail(f"no tiny builder for this family (tests/{module}.py): {e}")
        return getattr(mod, fn)(*args, **kwargs)

    build.__name__ = build.__qualname__ = fn
    return build


@dataclass(frozen=True)
class Family:
    name: str
    builder: Callable[..., tuple]  # (seed=0, init=...) -> (model, processor)
    requests: dict[str, Request]  # name -> request; the contract's verify and AR checks run on every one
    commit_on: tuple[str, ...]  # the requests check_commit_then_continue runs on
    verify_nodes: int = 14  # check_verify_matches_paths(n=...)
    verify_seeds: tuple[int, ...] = (0, 1, 2)  # one random tree per seed
    ar_new_tokens: int = 32  # check_ar_equals_hf(max_new_tokens=...)
    ar_min_distinct: int = 8  # the AR output has at least this many distinct tokens
    commit_steps: int = 16  # check_commit_then_continue(steps=...)


def _family(name: str, module: str, fn: str, requests: dict[str, Request], commit_on=None, **params) -> Family:
    return Family(name, _lazy(module, fn), requests, tuple(commit_on or requests), **params)


_WIDE = random_image(96, 60, seed=5)  # anyres: an 8x8 (NeXT) / 8x12 (OneVision) patch grid, unpadded to 6 rows
_SQUARE = random_images(1, seed=1)[0]

FAMILIES: dict[str, Family] = {f.name: f for f in (
    _family("llava", "tiny", "tiny_llava", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }, commit_on=("image", "video")),
    _family("llava_next", "tiny_llava_next", "tiny_llava_next", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=(_WIDE, random_images(1, seed=2)[0])),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(3, seed=3)),)),  # sent as frames
    }, commit_on=("image", "two_images", "video")),
    _family("llava_next_video", "tiny_llava_next_video", "tiny_llava_next_video", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=(_WIDE,)),  # anyres: 16 base + 6x8 grid + 6 newlines
        "two_images": Request(prompt="what is there", images=(random_images(1, seed=2)[0], _WIDE)),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),  # native video
        "image_and_video": Request(prompt="what is there and what is happening", images=(_SQUARE,),
                                   videos=(tuple(random_images(3, seed=4)),)),
    }, commit_on=("image", "video", "image_and_video")),
    _family("llava_onevision", "tiny_llava_onevision", "tiny_llava_onevision", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=(_WIDE,)),  # one image: anyres
        "two_images": Request(prompt="what is there", images=(random_images(1, seed=2)[0], _WIDE)),  # base views
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),  # native video
    }, commit_on=("image", "two_images", "video")),
    _family("qwen2_5_vl", "tiny_qwen2_5_vl", "tiny_qwen2_5_vl", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }),
    _family("qwen2_vl", "tiny_qwen2_vl", "tiny_qwen2_vl", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }),
    _family("qwen3_vl", "tiny_qwen3_vl", "tiny_qwen3_vl", {  # a clip: one run of tokens per 2-frame group
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }),
    _family("qwen3_vl_moe", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }),
    _family("internvl", "tiny_internvl", "tiny_internvl", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=(_WIDE,)),
        "two_images": Request(prompt="what is there", images=(random_images(1, seed=2)[0], _WIDE)),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }),
    _family("mistral3", "tiny_mistral3", "tiny_mistral3", {  # no video input
        "text": TEXT,
        "image": Request(prompt="describe the image", images=(_WIDE,)),  # 64x48: 3 rows of 4 [IMG] + breaks/end
        "two_images": Request(prompt="what is there", images=(random_images(1, seed=2)[0], _WIDE)),
    }),
    _family("glm4v", "tiny_glm4v", "tiny_glm4v", {  # a clip: one image block per 2-frame group, all <|image|>
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }),
    _family("glm4v_moe", "tiny_glm4v", "tiny_glm4v_moe", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),)),
    }),
    _family("idefics3", "tiny_idefics3", "tiny_idefics3", {  # no video input
        "text": TEXT,
        "image": Request(prompt="describe the image", images=(_SQUARE,)),  # 96x96 -> 64x64 -> 2x2 tiles + global
        "two_images": Request(prompt="what is there",  # the 96x48 one -> 64x32 -> 1x2 tiles + global view
                              images=(_SQUARE, random_images(1, seed=2)[0].resize((96, 48)))),
    }),
    _family("gemma3", "tiny_gemma3", "tiny_gemma3", {
        "text": TEXT,
        "image": Request(prompt="describe the image", images=tuple(random_images(1, seed=1))),
        "two_images": Request(prompt="what is there", images=tuple(random_images(2, seed=2))),
        "video": Request(prompt="what is happening", videos=(tuple(random_images(3, seed=3)),)),  # sent as 3 frames
    }),
)}


def build_target(family: str, **wrap_kwargs) -> VLMTarget:
    """A fresh wrapped target of `family`'s tiny model (the builder's defaults)."""
    return wrap(*FAMILIES[family].builder(), **wrap_kwargs)
