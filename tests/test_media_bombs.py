"""Aspect-ratio bombs: a few bytes of long thin PNG that a CLIP-style processor would scale up to gigabytes. Refused
from the header, before any pixel is decoded or processed, in the media layer, as a batch row error and as a 400
from the Serve endpoint's request path (`to_request`, as a unit: no Ray)."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.batch.rows import RowError, prepare_row, resolve_image_side
from mmspec_ray.config import MediaLimits
from mmspec_ray.media import MediaError, load_image, load_video
from mmspec_ray.media.image import check_shape, decode_image_bytes, processed_size
from mmspec_ray.serve.errors import APIError
from mmspec_ray.serve.messages import to_request
from mmspec_ray.serve.settings import ServeSettings
from mmspec_ray.targets.media_size import short_side_of
from mmspec_ray.toy.clips import encode_mp4


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (30, 120, 200)).save(buf, "PNG")
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def test_a_long_thin_png_is_refused_naming_its_aspect_ratio_and_the_limit():
    bomb = png(20000, 1)
    assert len(bomb) < 200  # the whole attack
    for data, shape in ((bomb, "20000x1"), (png(1, 20000), "1x20000")):
        with pytest.raises(MediaError, match=rf"{shape} image: aspect ratio 20000:1 > limit 200:1 "
                           r"\(media.limits.max_aspect_ratio\)") as e:
            decode_image_bytes(data)
        assert e.value.kind == "aspect_ratio"
    assert decode_image_bytes(png(199, 1)).size == (199, 1)  # inside Qwen2-VL's own 200:1
    assert decode_image_bytes(png(200, 1)).size == (200, 1)
    with pytest.raises(MediaError, match=r"201x1 image: aspect ratio 201:1 > limit 200:1"):
        decode_image_bytes(png(201, 1))
    with pytest.raises(MediaError, match=r"aspect ratio 3:1 > limit 2.5:1"):
        load_image(png(30, 10), limits=MediaLimits(max_aspect_ratio=2.5))


def test_the_processed_size_is_bounded_before_processing():
    """The size a shortest-edge processor makes (short side scaled to its side, long side grown with the ratio) is
    refused past max_processed_pixels, even inside the ratio limit; no short side: no such bound."""
    assert processed_size(20000, 1, 96) == (1_920_000, 96)
    assert processed_size(1, 20000, 336) == (336, 6_720_000)
    assert processed_size(4000, 3000, 336) == (448, 336)
    low = MediaLimits(max_processed_pixels=96 * 96 * 50)
    check_shape(50 * 10, 10, low, short_side=96)  # 4800 x 96: exactly the budget
    with pytest.raises(MediaError, match=r"510x10 image: the target's processor scales its short side to 96 px, "
                       r"making it 4896x96 = 470016 pixels > limit 460800 \(media.limits.max_processed_pixels\)"
                       ) as e:
        decode_image_bytes(png(510, 10), low, short_side=96)
    assert e.value.kind == "aspect_ratio"
    assert decode_image_bytes(png(510, 10), low).size == (510, 10)  # no short-side resize in the processor
    # The defaults: every ratio up to 200:1 passes a 336 px CLIP processor; a 1024 px one gets ~23:1.
    check_shape(200, 1, MediaLimits(), short_side=336)
    check_shape(23, 1, MediaLimits(), short_side=1024)
    with pytest.raises(MediaError, match="max_processed_pixels"):
        check_shape(24, 1, MediaLimits(), short_side=1024)


@pytest.mark.parametrize("size", [(4000, 3000), (3000, 4000), (1170, 2532), (1280, 10000), (5760, 1080), (96, 96)])
@pytest.mark.parametrize("side", [None, 96, 224, 336, 448])
def test_ordinary_images_and_the_toy_world_pass_the_defaults(size, side):
    """Photos, phone and long page screenshots, panoramas, and the toy worlds' 96 px images."""
    check_shape(*size, MediaLimits(), short_side=side)


def test_video_frames_follow_the_same_rule():
    thin = encode_mp4([Image.new("RGB", (804, 2), (i * 40, 0, 0)) for i in range(4)], fps=4)
    with pytest.raises(MediaError, match=r"804x2 frames: aspect ratio 402:1 > limit 200:1 "
                       r"\(media.limits.max_aspect_ratio\)") as e:
        load_video(thin, num_frames=2)
    assert e.value.kind == "aspect_ratio"
    wide = encode_mp4([Image.new("RGB", (400, 2), (i * 40, 0, 0)) for i in range(4)], fps=4)
    assert load_video(wide, num_frames=2).frames[0].size == (400, 2)
    with pytest.raises(MediaError, match=r"400x2 frames: .* > limit 10000 \(media.limits.max_processed_pixels\)"):
        load_video(wide, num_frames=2, limits=MediaLimits(max_processed_pixels=10_000), short_side=8)


def test_short_side_is_read_from_the_processor_configs(tmp_path):
    """Only a CLIP-style shortest_edge resize grows with the aspect ratio; pixel counts (Qwen), anyres tiles, a
    longest edge or a fixed size bound the processed size themselves."""
    clip = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
    qwen = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14}
    qwen3 = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}
    anyres = {"size": {"shortest_edge": 384}, "image_grid_pinpoints": [[384, 768], [768, 384]]}
    idefics = {"size": {"longest_edge": 1456}}
    fixed = {"size": {"height": 896, "width": 896}}
    assert [short_side_of([c]) for c in (clip, qwen, qwen3, anyres, idefics, fixed)] == [336, None, None, None,
                                                                                         None, None]
    assert short_side_of([{"size": 224}]) == 224 and short_side_of([{"video_processor": clip}, fixed]) == 336
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(clip))
    cfg = resolve_image_side(DecodeConfig(target=str(tmp_path)))
    assert (cfg.media.image_side, cfg.media.short_side) == (336, 336)
    kept = DecodeConfig(target=str(tmp_path), media={"image_side": 100, "short_side": None})
    assert resolve_image_side(kept).media == kept.media


@pytest.fixture(scope="module")
def cfg(ckpt):
    return DecodeConfig(target=ckpt, drafter="ngram")


def test_a_batch_row_gets_an_error_naming_the_field(cfg, tmp_path):
    with pytest.raises(RowError, match=r"^image: aspect_ratio: 20000x1 image: aspect ratio 20000:1 > limit 200:1 "
                       r"\(media.limits.max_aspect_ratio\)") as e:
        prepare_row({"id": "r", "prompt": "p", "image": png(20000, 1)}, cfg)
    assert (e.value.field, e.value.kind) == ("image", "media.aspect_ratio")
    path = tmp_path / "thin.png"
    path.write_bytes(png(1, 20000))
    (tmp_path / "ok.png").write_bytes(png(64, 48))
    with pytest.raises(RowError, match=r"^image_uri\[1\]: aspect_ratio: 1x20000 image") as e:
        prepare_row({"id": "r", "prompt": "p", "image_uri": [str(tmp_path / "ok.png"), str(path)]}, cfg)
    assert (e.value.field, e.value.kind) == ("image_uri[1]", "media.aspect_ratio")
    inside = prepare_row({"id": "r", "prompt": "p", "image": png(19900, 100)}, resolve_image_side(cfg))
    assert inside.images[0].size == (19104, 96)  # 199:1 passes, scaled down to the processor's 96 px


def test_the_processed_size_bound_holds_with_the_resolved_short_side(cfg):
    """The tiny LLaVA's processor scales the short side to 96 px: the config resolved as a job or a replica
    resolves it (`resolve_image_side`) carries it, and the bound refuses from the header."""
    low = resolve_image_side(cfg.model_copy(update={"media": cfg.media.model_copy(update={
        "limits": MediaLimits(max_processed_pixels=96 * 96 * 20)})}))
    assert low.media.short_side == 96
    with pytest.raises(RowError, match=r"2100x100 image: the target's processor scales its short side to 96 px") as e:
        prepare_row({"id": "r", "prompt": "p", "image": png(2100, 100)}, low)
    assert e.value.kind == "media.aspect_ratio"


def test_the_serve_request_path_answers_400(cfg):
    settings = ServeSettings(decode=cfg)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image_part(png(20000, 1))]}]
    with pytest.raises(APIError) as e:
        to_request(messages, settings)
    err = e.value
    assert (err.status, err.code, err.param) == (400, "media_aspect_ratio", "messages[0].content[1].image_url")
    assert "aspect ratio 20000:1 > limit 200:1 (media.limits.max_aspect_ratio)" in err.message
    low = ServeSettings(decode=resolve_image_side(cfg.model_copy(update={"media": cfg.media.model_copy(update={
        "limits": MediaLimits(max_processed_pixels=96 * 96 * 20)})})))  # as a replica passes it
    messages[0]["content"][1] = image_part(png(2100, 100))
    with pytest.raises(APIError) as e:
        to_request(messages, low)
    assert (e.value.status, e.value.code) == (400, "media_aspect_ratio")
    assert "media.limits.max_processed_pixels" in e.value.message
    messages[0]["content"][1] = image_part(png(199, 1))
    assert to_request(messages, settings).images[0].size == (199, 1)
