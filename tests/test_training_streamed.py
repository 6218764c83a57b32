"""What lets every method train where the target is not loaded (Ray Train workers), and train as it drafts:
examples store the target's own cut of their media into images / frames / temporal groups (the cut the drafter
meets at inference, per family), and a method that selects its data with the target (HiViS) gets that selection
per shard, made where the target is loaded. The whole Ray Train run of every method: tests/test_train_scale.py."""

from __future__ import annotations

import pytest
import torch

from mmspec_ray.drafters.vispec import entry_spans
from mmspec_ray.targets import Request
from mmspec_ray.targets.base import pieces_of
from mmspec_ray.training.datagen import DatagenRecipe, answer_and_featurize, featurize
from mmspec_ray.training.distributed import selected_manifest
from mmspec_ray.training.methods import example_pieces, training_method
from mmspec_ray.training.pipeline import check_streamable
from mmspec_ray.training.shards import ShardStore, examples_from_bytes, shard_bytes
from mmspec_ray.training.specflash import COMPRESSED
from families import build_target
from tiny import random_images

CLIP = Request(prompt="what is happening", videos=(tuple(random_images(4, seed=3)),))
IMAGES = Request(prompt="what is there", images=tuple(random_images(2, seed=2)))


@pytest.fixture(scope="module", params=["llava", "llava_onevision", "qwen2_5_vl"])
def video_target(request):
    torch.manual_seed(0)
    return request.param, build_target(request.param)


def test_examples_store_the_media_cut_the_drafter_meets_when_it_drafts(video_target):
    """On every video family the stored segments are the prefill's own (per frame on OneVision, per temporal group
    on Qwen2.5-VL), where the ids alone leave a clip whole; they survive a shard round trip; SpecFLASH and ViSpec
    collate by them."""
    family, target = video_target
    recipe = DatagenRecipe(max_new_tokens=4)
    for req in (CLIP, IMAGES):
        ex = answer_and_featurize(target, req, recipe)
        assert ex is not None and ex.segments is not None
        with torch.inference_mode():
            pre = target.prefill(target.encode(req))
        drafted = pieces_of(pre.media_segments[0])
        assert ex.pieces() == drafted, (family, req.prompt)
        again = examples_from_bytes(shard_bytes([ex]))[0]
        assert again.pieces() == drafted and torch.equal(again.segments, ex.segments)
        if req is CLIP:
            from_ids = target.media_pieces(ex.input_ids)
            expected = {"llava": 4, "llava_onevision": 4, "qwen2_5_vl": 2}[family]  # frames / temporal groups
            assert len(drafted) == expected, (family, drafted)
            if family != "llava":  # the ids alone cannot cut these clips: what training used before segments
                assert len(from_ids) == 1 and example_pieces(ex, None) == drafted
        gen = torch.Generator().manual_seed(0)
        sf = training_method("specflash")
        sf.head(target)
        item = sf.collate([ex], [0], 0.0, gen)["items"][0]
        assert item["pieces"].shape[0] == len(drafted), family  # one compressed block per image / frame / group
        assert int((item["kind"] == COMPRESSED).sum()) > 0
        vs = training_method("vispec")
        vs.head(target)
        assert vs.collate([ex], [0], 0.0, gen)["spans"] == [entry_spans(drafted)]


def test_hivis_selection_per_shard_is_what_select_keeps():
    """The per-shard selection (made where the target is loaded) keeps exactly the examples `select` keeps, and
    the manifest a worker plans its steps with counts them."""
    target = build_target("llava")
    recipe = DatagenRecipe(max_new_tokens=12)
    long = target.tokenizer.encode(" a red star is left of the large blue circle", add_special_tokens=False)
    short = target.tokenizer.encode(" a red star", add_special_tokens=False)
    pool = [featurize(target, Request(prompt="describe the image", images=(img,)), answer, recipe)
            for img, answer in zip(random_images(4, seed=4), (long, short, long, long))]
    pool.append(featurize(target, Request(prompt="say something"), short, recipe))
    m = training_method("hivis")  # multimodal answers of five words or fewer are dropped
    kept_mm, kept_text = m.select(target, [e for e in pool if e.multimodal], [e for e in pool if not e.multimodal])
    sel = m.shard_selection(target, pool)
    applied = m.apply_selection(pool, sel)
    assert [id(e) for e in applied] == [id(e) for e in pool if any(e is k for k in kept_mm + kept_text)]
    assert all(e is not pool[1] for e in applied) and len(applied) == len(pool) - 1 and sel["multimodal"] == 3
    manifest = {"shards": ["shard-a", "shard-b"], "examples_per_shard": [5, 4], "multimodal_per_shard": [4, 4]}
    planned = selected_manifest(manifest, {"shard-a": sel, "shard-b": {"keep": [0, 2], "multimodal": 2,
                                                                       "marked": []}})
    assert planned["examples_per_shard"] == [4, 2] and planned["multimodal_per_shard"] == [3, 2]
    with pytest.raises(ValueError, match="no entry for shard"):
        selected_manifest(manifest, {"shard-a": sel})
    assert training_method("eagle2").apply_selection(pool, {"keep": [0], "multimodal": 1, "marked": []})[0] is pool[0]


def test_ray_train_refuses_media_cutting_methods_on_features_stored_without_segments(tmp_path):
    """Features made before examples carried their segments train SpecFLASH / ViSpec on one process only (the
    target cuts them there); Ray Train says so by name before any worker starts; other methods take them."""
    target = build_target("llava")
    ex = answer_and_featurize(target, IMAGES, DatagenRecipe(max_new_tokens=4))
    old = type(ex)(ex.input_ids, ex.hidden, ex.embeds, ex.n_prompt, ex.media)
    for name, examples in (("new", [ex]), ("old", [old])):
        store = ShardStore(str(tmp_path / name))
        store.write_shard("shard-00000.safetensors", examples, ["0"])
        manifest = store.write_manifest({})
        for method in ("specflash", "vispec", "eagle2", "hivis"):
            m = training_method(method)
            if name == "old" and m.cuts_media:
                with pytest.raises(ValueError, match=f"{method} on Ray Train needs the media segments"):
                    check_streamable(m, store, manifest)
                with pytest.raises(ValueError, match="stored without their media segments"):
                    example_pieces(old, None)
            else:
                check_streamable(m, store, manifest)
    assert example_pieces(old, target) == ex.pieces()  # one process: the target cuts them (same on LLaVA)
