"""`load_target` end to end: save_pretrained round trips per family, s3:// checkpoints (moto) with the local cache,
and the clear `TargetError`s for broken or unsupported checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, LlamaConfig, LlamaForCausalLM
from transformers.utils import is_torchvision_available

import mmspec_ray.media.io
from mmspec_ray.decoding.engine import AREngine
from mmspec_ray.targets import Request, TargetError, families, load_target, wrap
from mmspec_ray.targets.registry import checkpoint_cache
from families import FAMILIES
from tiny import random_images, tiny_llava, tiny_tokenizer

# Families whose tiny processor is a torchvision-free stand-in subclass (see the tiny builders), with the stock
# processor / video processor classes a real checkpoint of that family names in processor_config.json.
STAND_IN = {
    "llava_next_video": ("LlavaNextVideoProcessor", "LlavaNextVideoVideoProcessor"),
    "llava_onevision": ("LlavaOnevisionProcessor", "LlavaOnevisionVideoProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    "qwen3_vl_moe": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    "glm4v": ("Glm4vProcessor", "Glm4vVideoProcessor"),
    "glm4v_moe": ("Glm4vProcessor", "Glm4vVideoProcessor"),
    "internvl": ("InternVLProcessor", "InternVLVideoProcessor"),
    "mistral3": ("PixtralProcessor", None),  # no video processor: PixtralProcessor itself needs torchvision
}
ROUND_TRIP = [f for f in FAMILIES if f not in STAND_IN]
NEW_TOKENS = 16
REQUEST = Request(prompt="describe the image", images=tuple(random_images(1, seed=11)))


def build(family: str):
    torch.manual_seed(0)
    return FAMILIES[family].builder()


def greedy(target) -> list[int]:
    ids = AREngine(target).generate(REQUEST, max_new_tokens=NEW_TOKENS).token_ids
    assert len(ids) == NEW_TOKENS and len(set(ids)) >= 4, ids  # varied, so equality below means something
    return ids


def save(model, processor, path: Path) -> Path:
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


# ---------------------------------------------------------------- save_pretrained -> load_target, per family


@pytest.mark.parametrize("family", ROUND_TRIP)
def test_saved_checkpoint_loads_to_the_same_greedy_output(family, tmp_path):
    model, processor = build(family)
    before_target = wrap(model, processor)
    before = greedy(before_target)
    target = load_target(save(model, processor, tmp_path))
    assert type(target) is families()[family] and type(target).family == family
    assert type(target.processor) is type(processor)  # the stock processor class, not a tokenizer fallback
    a, b = before_target.encode(REQUEST), target.encode(REQUEST)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert torch.allclose(a["pixel_values"], b["pixel_values"], atol=1e-6)
    assert greedy(target) == before


@pytest.mark.parametrize("family", list(STAND_IN))
def test_stand_in_processor_families_fail_clearly_and_their_weights_round_trip(family, tmp_path):
    """LLaVA-OneVision and Qwen2.5-VL cannot round-trip a processor here, and that must fail loudly.

    Their stock processors need a video processor, and transformers builds those only with torchvision, which has no
    CPU build on this machine; the tiny builders therefore use stand-in subclasses (tests/tiny_llava_onevision.py,
    tests/tiny_qwen2_5_vl.py). So:
    1. saved as is, processor_config.json names the test-only subclass; AutoProcessor does not know it and quietly
       returns the bare tokenizer (images would be dropped): load_target must refuse that with a TargetError;
    2. with the stock class names a real checkpoint carries, AutoProcessor needs torchvision: a TargetError that
       says so (with torchvision installed the checkpoint must load instead);
    3. the model itself (config + weights) does round-trip: the stock AutoModel reload, wrapped with the in-memory
       processor, gives the right adapter and the same greedy output.
    """
    model, processor = build(family)
    before = greedy(wrap(model, processor))
    save(model, processor, tmp_path)

    with pytest.raises(TargetError, match=rf"AutoProcessor loaded only a \w+, not a multimodal processor "
                                          rf"\(processor_class '{type(processor).__name__}' is not a transformers"):
        load_target(tmp_path)

    stock_processor, stock_video = STAND_IN[family]
    cfg_file = tmp_path / "processor_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["processor_class"] = stock_processor
    if stock_video:
        cfg["video_processor"]["video_processor_type"] = stock_video
    cfg_file.write_text(json.dumps(cfg))
    if is_torchvision_available():
        target = load_target(tmp_path)
        assert type(target).family == family and type(target.processor).__name__ == stock_processor
    else:
        with pytest.raises(TargetError, match=rf"cannot load the {family} processor saved in .*needs torchvision.*"
                                              rf"{stock_video or stock_processor} requires the Torchvision library"):
            load_target(tmp_path)

    reloaded = wrap(AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32), processor)
    assert type(reloaded) is families()[family]
    assert greedy(reloaded) == before


# ---------------------------------------------------------------- s3:// checkpoints


@pytest.fixture(scope="module")
def llava_ckpt(tmp_path_factory):
    """A saved tiny LLaVA (single file and sharded) and the greedy output of its local load."""
    model, processor = tiny_llava()
    root = tmp_path_factory.mktemp("llava_ckpt")
    local = save(model, processor, root / "single")
    sharded = root / "sharded"
    model.save_pretrained(sharded, max_shard_size="200KB")
    processor.save_pretrained(sharded)
    return local, sharded, greedy(load_target(local))


def upload(server, bucket: str, prefix: str, src: Path, skip: tuple[str, ...] = ()) -> str:
    for f in sorted(src.iterdir()):
        if f.name not in skip:
            server.put(bucket, f"{prefix}/{f.name}", f.read_bytes())
    return f"s3://{bucket}/{prefix}"


def test_s3_checkpoint_matches_local_and_second_load_uses_the_cache(s3_server, llava_ckpt, tmp_path, monkeypatch):
    local, _, ref = llava_ckpt
    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    bucket = s3_server.new_bucket()
    uri = upload(s3_server, bucket, "ckpts/tiny-llava", local)

    target = load_target(uri, s3=s3_server.s3_config)
    assert type(target).family == "llava"
    assert greedy(target) == ref
    (marker,) = checkpoint_cache().glob("*/.mmspec-complete")
    assert sorted(p.name for p in marker.parent.iterdir()) == sorted([".mmspec-complete"] +
                                                                    [p.name for p in local.iterdir()])

    # Second load: served from the cache alone. Empty the bucket and forbid building an S3 client at all.
    for f in local.iterdir():
        s3_server.client.delete_object(Bucket=bucket, Key=f"ckpts/tiny-llava/{f.name}")

    def no_s3(*a, **k):
        raise AssertionError("a cached checkpoint must not touch S3")

    monkeypatch.setattr(mmspec_ray.media.io, "s3_filesystem", no_s3)
    again = load_target(uri + "/", s3=s3_server.s3_config)  # a trailing slash names the same prefix
    assert greedy(again) == ref


def test_s3_incomplete_upload_is_refused_then_resumed(s3_server, llava_ckpt, tmp_path, monkeypatch):
    local, _, ref = llava_ckpt
    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    bucket = s3_server.new_bucket()
    tok_files = ("tokenizer.json", "tokenizer_config.json")
    uri = upload(s3_server, bucket, "ckpt", local, skip=tok_files)
    with pytest.raises(TargetError, match=rf"{re.escape(uri)} is not a complete checkpoint: .*no tokenizer files"):
        load_target(uri, s3=s3_server.s3_config)
    assert not list(checkpoint_cache().glob("*/.mmspec-complete"))  # never marked complete
    (weights,) = checkpoint_cache().glob("*/model.safetensors")
    stamp = weights.stat().st_mtime_ns

    for name in tok_files:
        s3_server.put(bucket, f"ckpt/{name}", (local / name).read_bytes())
    assert greedy(load_target(uri, s3=s3_server.s3_config)) == ref
    assert weights.stat().st_mtime_ns == stamp  # files already mirrored are not fetched again


def test_s3_missing_prefix_or_bucket_names_the_uri(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    bucket = s3_server.new_bucket()
    s3_server.put(bucket, "other/config.json", b"{}")
    uri = f"s3://{bucket}/no/such/prefix"
    with pytest.raises(TargetError, match=rf"no checkpoint files under {re.escape(uri)}$"):
        load_target(uri, s3=s3_server.s3_config)
    uri = f"s3://{bucket}-missing/ckpt"
    with pytest.raises(TargetError, match=rf"no checkpoint files under {re.escape(uri)}$"):
        load_target(uri, s3=s3_server.s3_config)


# ---------------------------------------------------------------- clear errors for broken checkpoints


def copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst, ignore=lambda d, files: [f for f in files if f in names])
    return dst


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(llava_ckpt, tmp_path):
    _, sharded, ref = llava_ckpt
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert greedy(load_target(sharded)) == ref
    broken = copy_without(sharded, tmp_path / "ckpt", shards[1])
    with pytest.raises(TargetError, match=rf"is incomplete: missing weight shards \['{re.escape(shards[1])}'\]"):
        load_target(broken)


def make_llama_only(path: Path) -> Path:
    """A complete, loadable checkpoint of a text-only model: no VLM adapter exists for it."""
    cfg = LlamaConfig(vocab_size=len(tiny_tokenizer()), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


BROKEN = {  # name -> (make the checkpoint from the saved tiny LLaVA, expected message)
    "missing_dir": (lambda src, d: d / "nope", r"checkpoint .*nope does not exist or is not a directory"),
    "not_a_dir": (lambda src, d: src / "config.json", r"checkpoint .*config.json does not exist or is not a directory"),
    "no_config": (lambda src, d: copy_without(src, d / "c", "config.json"),
                  r"has no config.json; is this a save_pretrained directory\?"),
    "no_weights": (lambda src, d: copy_without(src, d / "c", "model.safetensors"),
                   r"has no weights \(model.safetensors\)"),
    "no_tokenizer": (lambda src, d: copy_without(src, d / "c", "tokenizer.json", "tokenizer_config.json"),
                     r"has no tokenizer files; save the processor next to the model"),
    "unsupported_model_type": (lambda src, d: make_llama_only(d / "c"),
                               r"model type 'llama' has no target adapter; supported: \[.*'llava'.*\]"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoints_raise_a_helpful_target_error(case, llava_ckpt, tmp_path):
    make, message = BROKEN[case]
    with pytest.raises(TargetError, match=message):
        load_target(make(llava_ckpt[0], tmp_path))
