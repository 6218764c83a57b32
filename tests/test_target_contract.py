"""The target contract, for every family and each of its standard requests (tests/families.py): verify(tree) ==
each root-to-leaf path run alone, AREngine greedy == HF generate with varied output, commit-then-continue ==
an uninterrupted greedy run. The checks live in tests/target_checks.py; family-specific tests stay in
tests/test_targets_<family>.py."""

from __future__ import annotations

import re

import pytest
import torch

from families import FAMILIES, build_target
from mmspec_ray.targets import InvalidRequest, Request, TargetError
from target_checks import check_ar_equals_hf, check_commit_then_continue, check_verify_matches_paths

ALL = [(f.name, r) for f in FAMILIES.values() for r in f.requests]
COMMIT = [(f.name, r) for f in FAMILIES.values() for r in f.commit_on]


def _ids(cases):
    return [f"{family}-{name}" for family, name in cases]


@pytest.fixture(scope="module")
def targets():
    """family -> its wrapped tiny target, built on first use and shared by this module's tests (as each family
    module shares one target)."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_target(family)
        return built[family]

    return get


@pytest.mark.parametrize("family,name", ALL, ids=_ids(ALL))
def test_verify_tree_matches_each_path(targets, family, name):
    f = FAMILIES[family]
    for seed in f.verify_seeds:
        check_verify_matches_paths(targets(family), f.requests[name], n=f.verify_nodes, seed=seed)


@pytest.mark.parametrize("family,name", ALL, ids=_ids(ALL))
def test_ar_equals_hf_generate_and_is_varied(targets, family, name):
    f = FAMILIES[family]
    ids = check_ar_equals_hf(targets(family), f.requests[name], max_new_tokens=f.ar_new_tokens)
    assert len(set(ids)) >= f.ar_min_distinct, ids


@pytest.mark.parametrize("family,name", COMMIT, ids=_ids(COMMIT))
def test_commit_then_continue(targets, family, name):
    f = FAMILIES[family]
    check_commit_then_continue(targets(family), f.requests[name], steps=f.commit_steps)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_placeholders_typed_into_the_text_are_refused_naming_the_field(targets, family):
    """A typed media placeholder gave the processor's raw ValueError (LLaVA, LLaVA-NeXT, Qwen2.5-VL) or shifted
    media; every family refuses it with an InvalidRequest naming the field and the token."""
    target = targets(family)
    image = FAMILIES[family].requests["image"].images
    token = target.processor.image_token
    with pytest.raises(InvalidRequest, match=rf"^prompt contains the image placeholder token '{re.escape(token)}'; "
                                             "remove it"):
        target.encode(Request(prompt=f"describe {token} this", images=image))
    parts = [{"type": "image"}, {"type": "text", "text": f"{token}describe"}]
    with pytest.raises(InvalidRequest, match=r"^messages\[0\]\.content\[1\]\.text contains the image placeholder"):
        target.encode(Request(messages=[{"role": "user", "content": parts}], images=image))
    video = getattr(target.processor, "video_token", None)
    if video:
        with pytest.raises(InvalidRequest, match=r"^prompt contains the video placeholder token"):
            target.encode(Request(prompt=f"what {video}", images=image))
    target.encode(Request(prompt="describe this", images=image))  # the clean request still encodes


VIDEO = [f.name for f in FAMILIES.values() if "video" in f.requests]


@pytest.mark.parametrize("family", VIDEO)
def test_a_video_part_in_explicit_messages_encodes_like_the_prompt_form(targets, family):
    """Explicit messages naming a clip with one {'type': 'video'} part encode exactly as the prompt form of the same
    request (LLaVA and Gemma3 sent the clip's frames with no placeholders: the processor's raw "Found total 0 <image>
    tokens and 3 images"); a video part before an image part keeps that order for frame families."""
    target = targets(family)
    clip = FAMILIES[family].requests["video"].videos
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what is happening"}]}]
    got = target.encode(Request(messages=messages, videos=clip))
    want = target.encode(Request(prompt="what is happening", videos=clip))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    with pytest.raises(TargetError, match=r"messages name 0 image\(s\) and 1 video\(s\) but the request carries 0 "
                                          r"image\(s\) and 2 video\(s\)"):
        target.encode(Request(messages=messages, videos=clip + clip))
