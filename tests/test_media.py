"""Media decoding: images and videos from bytes, paths, file:// and s3:// URIs; every bad input -> MediaError.

All fixtures are built in code (Pillow for images, PyAV for tiny 64x48 clips). Frame i of every clip is a flat
colour that encodes i, so a test can tell exactly which frames came back. Every decode runs under a timeout, so a
decoder that hangs on hostile input fails the test instead of stalling the suite.
"""

from __future__ import annotations

import io
import struct
import threading
import zlib
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from mmspec_ray.config import MediaLimits, S3Config
from mmspec_ray.media import MediaError, VideoClip, load_image, load_video
from mmspec_ray.media.image import decode_image_bytes
from mmspec_ray.media.io import read_bytes
import mmspec_ray.media.video as video_mod
from mmspec_ray.media.video import decode_video_bytes, mp4_box_overrun, uniform_indices

W, H = 64, 48  # frame / image size used throughout
N_FRAMES, FPS = 24, 12  # every test clip: 24 frames at 12 fps = 2.0 s
TIMEOUT_S = 20.0
ALL_KINDS = {"corrupt", "truncated", "empty", "too_large", "unsupported", "not_found", "io"}


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def bounded(fn, *args, timeout: float = TIMEOUT_S, **kwargs):
    """Call fn in a daemon thread; fail the test if it does not return within `timeout` s (a hang)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name=f"bounded-{getattr(fn, '__name__', 'call')}")
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {timeout:.0f} s (hang on bad input?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def media_error(fn, *args, kinds: str | tuple[str, ...], **kwargs) -> MediaError:
    """Assert that fn(*args) raises MediaError (a ValueError) of one of `kinds`, in bounded time; return it."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    with pytest.raises(MediaError) as ei:
        bounded(fn, *args, **kwargs)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.kind in ALL_KINDS
    assert err.kind in kinds, f"got kind {err.kind!r}, expected one of {kinds}: {err}"
    assert str(err).startswith(f"{err.kind}: "), str(err)
    return err


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def px(img: Image.Image, x: int, y: int) -> np.ndarray:
    return np.asarray(img)[y, x].astype(int)


def colour(i: int) -> tuple[int, int, int]:
    """The flat RGB colour of frame i (i < 26): red rises and green falls by 10 per frame."""
    return (10 * i, 255 - 10 * i, 128)


def frame_index(img: Image.Image) -> int:
    """Recover i from a decoded frame painted with colour(i); asserts the estimate is unambiguous."""
    r, g, _ = np.asarray(img)[8:-8, 8:-8].reshape(-1, 3).mean(axis=0)
    est = (r + (255.0 - g)) / 20.0
    i = int(round(est))
    assert abs(est - i) < 0.35, f"frame colour {r:.1f},{g:.1f} is not a clean frame index ({est:.2f})"
    return i


def make_clip(codec: str = "h264", n: int = N_FRAMES, fps: int = FPS, fmt: str = "mp4",
              path: Path | None = None, options: dict | None = None) -> bytes:
    """Encode n flat frames colour(0..n-1) at `fps`; return the file bytes (written to `path` when given)."""
    target = str(path) if path is not None else io.BytesIO()
    with av.open(target, "w", format=fmt, options=options or {}) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        if codec in ("h264", "libx264"):
            s.options = {"preset": "ultrafast", "crf": "8"}
        else:
            s.bit_rate = 2_000_000
        for i in range(n):
            arr = np.empty((H, W, 3), np.uint8)
            arr[:] = colour(i)
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path.read_bytes() if path is not None else target.getvalue()


def make_audio(fmt: str) -> bytes:
    """One second of silence, audio stream only: 'wav' (PCM) or 'mp4' (AAC)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        if fmt == "wav":
            s = c.add_stream("pcm_s16le", rate=8000)
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 8000), np.int16), format="s16", layout="mono")
        else:
            s = c.add_stream("aac", rate=8000)
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 8000), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def top_level_boxes(data: bytes) -> dict[str, tuple[int, int]]:
    """MP4 top-level boxes: name -> (offset, size)."""
    out, off = {}, 0
    while off + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[off:off + 8])
        out[kind.decode("latin-1")] = (off, size)
        off += size
    return out


def png_with_size(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width x height (valid CRC); the pixel data is not there."""
    png = encode(Image.new("RGB", (1, 1)), "PNG")
    assert png[12:16] == b"IHDR"
    ihdr = struct.pack(">II", width, height) + png[24:29]
    return png[:8] + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + png[33:]


def check_clip(clip: VideoClip, indices: list[int], total: int = N_FRAMES, fps: float = FPS) -> None:
    """The clip holds exactly frames `indices` of a flat-colour test clip, in order, with matching timestamps."""
    assert isinstance(clip, VideoClip)
    assert len(clip.frames) == len(clip.timestamps) == len(indices)
    for img in clip.frames:
        assert isinstance(img, Image.Image)
        assert img.mode == "RGB"
        assert img.size == (W, H)
    assert [frame_index(f) for f in clip.frames] == indices
    assert clip.timestamps == pytest.approx([i / fps for i in indices], abs=2e-3)
    assert clip.total_frames == total
    assert clip.duration == pytest.approx(total / fps, abs=0.02)
    assert clip.source_fps == pytest.approx(fps, rel=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rgb_array() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def png_bytes(rgb_array) -> bytes:
    return encode(Image.fromarray(rgb_array), "PNG")


@pytest.fixture(scope="module")
def jpeg_bytes(rgb_array) -> bytes:
    return encode(Image.fromarray(rgb_array), "JPEG", quality=90)


@pytest.fixture(scope="module", params=["h264", "mpeg4"])
def mp4(request) -> bytes:
    """A 24-frame, 12 fps, 64x48 mp4 (moov atom at the end, the muxer's default)."""
    return make_clip(request.param)


@pytest.fixture(scope="module")
def mp4_h264() -> bytes:
    return make_clip("h264")


@pytest.fixture(scope="module")
def mp4_faststart(tmp_path_factory) -> bytes:
    """Same clip with the moov atom first (web-optimised): a cut-off download still opens and decodes partly."""
    return make_clip("h264", path=tmp_path_factory.mktemp("faststart") / "clip.mp4",
                     options={"movflags": "faststart"})


@pytest.fixture(scope="module")
def mkv() -> bytes:
    """Matroska declares no frame count, which exercises the decode-everything-then-pick path."""
    return make_clip("mpeg4", fmt="matroska")


# ----------------------------------------------------------------------------------------------------------------
# images: good inputs
# ----------------------------------------------------------------------------------------------------------------


def test_png_decodes_losslessly(png_bytes, rgb_array):
    img = bounded(load_image, png_bytes)
    assert img.mode == "RGB" and img.size == (W, H)
    np.testing.assert_array_equal(np.asarray(img), rgb_array)


def test_jpeg_decodes_close_to_source():
    # A smooth gradient, so that JPEG's loss stays small and a wrong decode (channel swap, shift) would not.
    yy, xx = np.mgrid[0:H, 0:W]
    arr = np.stack([xx * 4, yy * 5, 255 - xx * 2], axis=-1).astype(np.uint8)
    img = bounded(load_image, encode(Image.fromarray(arr), "JPEG", quality=95))
    assert img.mode == "RGB" and img.size == (W, H)
    assert np.abs(np.asarray(img).astype(int) - arr.astype(int)).mean() < 3.0


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview], ids=["bytes", "bytearray", "memoryview"])
def test_bytes_like_sources(png_bytes, rgb_array, wrap):
    img = bounded(load_image, wrap(png_bytes))
    np.testing.assert_array_equal(np.asarray(img), rgb_array)


def test_rgba_alpha_is_composited_on_white():
    arr = np.zeros((H, W, 4), np.uint8)
    arr[:, :16] = (255, 0, 0, 255)  # opaque red
    arr[:, 16:32] = (0, 0, 255, 0)  # fully transparent blue -> must show as white, not blue or black
    arr[:, 32:48] = (0, 0, 0, 128)  # half-transparent black -> mid grey
    arr[:, 48:] = (0, 200, 0, 255)  # opaque green
    img = bounded(load_image, encode(Image.fromarray(arr, "RGBA"), "PNG"))
    assert img.mode == "RGB" and img.size == (W, H)
    assert px(img, 5, 5).tolist() == [255, 0, 0]
    assert px(img, 20, 5).tolist() == [255, 255, 255]
    assert np.all(np.abs(px(img, 40, 5) - 127) <= 1)
    assert px(img, 60, 5).tolist() == [0, 200, 0]


def test_la_alpha_is_composited_on_white():
    arr = np.zeros((H, W, 2), np.uint8)
    arr[:, : W // 2] = (50, 255)
    arr[:, W // 2:] = (0, 0)
    img = bounded(load_image, encode(Image.fromarray(arr, "LA"), "PNG"))
    assert px(img, 0, 0).tolist() == [50, 50, 50]
    assert px(img, W - 1, 0).tolist() == [255, 255, 255]


def test_l_mode_becomes_grey_rgb():
    arr = np.tile(np.arange(W, dtype=np.uint8) * 4, (H, 1))
    img = bounded(load_image, encode(Image.fromarray(arr, "L"), "PNG"))
    assert img.mode == "RGB" and img.size == (W, H)
    out = np.asarray(img)
    for ch in range(3):
        np.testing.assert_array_equal(out[..., ch], arr)


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_mode(fmt):
    p = Image.new("P", (W, H), 1)
    p.putpalette([0, 0, 0, 255, 0, 0, 0, 0, 255] + [0] * (256 - 3) * 3)
    p.paste(2, (0, 0, W // 2, H))
    assert Image.open(io.BytesIO(encode(p, fmt))).mode == "P"
    img = bounded(load_image, encode(p, fmt))
    assert img.mode == "RGB" and img.size == (W, H)
    assert px(img, 0, 0).tolist() == [0, 0, 255]
    assert px(img, W - 1, 0).tolist() == [255, 0, 0]


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_transparency_is_white(fmt):
    p = Image.new("P", (W, H), 1)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * 254 * 3)
    p.paste(0, (0, 0, W // 2, H))  # index 0 is black, but declared transparent
    data = encode(p, fmt, transparency=0)
    assert "transparency" in Image.open(io.BytesIO(data)).info
    img = bounded(load_image, data)
    assert px(img, 0, 0).tolist() == [255, 255, 255]
    assert px(img, W - 1, 0).tolist() == [255, 0, 0]


def test_16bit_greyscale_is_scaled_not_clipped():
    arr = (np.arange(W * H, dtype=np.uint32).reshape(H, W) * 20).astype(np.uint16)  # 0 .. 61420
    data = encode(Image.fromarray(arr), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    img = bounded(load_image, data)
    assert img.mode == "RGB" and img.size == (W, H)
    out = np.asarray(img)[..., 0].astype(int)
    assert out[0, 0] == 0
    assert out[-1, -1] == 255
    assert abs(out[H // 2, 0] - 127) <= 1
    # Scaling keeps the ramp: clipping to 8 bits would saturate almost every pixel at 255.
    assert (out == 255).mean() < 0.01
    assert np.all(np.diff(out.ravel()) >= 0)


@pytest.mark.parametrize("orientation, size, red_corner", [
    (1, (W, H), (0, 0)),
    (3, (W, H), (W - 1, H - 1)),  # 180 degrees
    (6, (H, W), (H - 1, 0)),  # display = stored rotated 90 degrees clockwise: top-left -> top-right
    (8, (H, W), (0, W - 1)),  # 90 degrees counter-clockwise: top-left -> bottom-left
])
def test_exif_orientation_is_applied(orientation, size, red_corner):
    img = Image.new("RGB", (W, H), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 16, 12))  # a red marker in the stored top-left corner
    exif = img.getexif()
    exif[0x0112] = orientation
    data = encode(img, "JPEG", quality=95, exif=exif.tobytes())
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112) == orientation
    out = bounded(load_image, data)
    assert out.mode == "RGB"
    assert out.size == size
    r, g, b = px(out, *red_corner)
    assert r > 200 and g < 60 and b < 60, (r, g, b)


def test_local_path_and_file_uri(tmp_path, png_bytes, rgb_array):
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes)
    for src in (str(path), f"file://{path}"):
        img = bounded(load_image, src)
        np.testing.assert_array_equal(np.asarray(img), rgb_array)


def test_jpeg_path(tmp_path, jpeg_bytes):
    path = tmp_path / "img.jpg"
    path.write_bytes(jpeg_bytes)
    img = bounded(load_image, str(path))
    assert img.mode == "RGB" and img.size == (W, H)
    # Same pixels as Pillow's own full decode of the file (no re-encoding, no colour conversion on the way).
    np.testing.assert_array_equal(np.asarray(img), np.asarray(Image.open(path).convert("RGB")))


def test_max_image_pixels_boundary(png_bytes):
    assert bounded(load_image, png_bytes, MediaLimits(max_image_pixels=W * H)).size == (W, H)
    err = media_error(load_image, png_bytes, MediaLimits(max_image_pixels=W * H - 1), kinds="too_large")
    assert f"{W}x{H}" in str(err)


def test_max_bytes_boundary(png_bytes, tmp_path):
    n = len(png_bytes)
    assert bounded(load_image, png_bytes, MediaLimits(max_bytes=n)).size == (W, H)
    media_error(load_image, png_bytes, MediaLimits(max_bytes=n - 1), kinds="too_large")
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes)
    err = media_error(load_image, str(path), MediaLimits(max_bytes=n - 1), kinds="too_large")
    assert err.source == str(path)


# ----------------------------------------------------------------------------------------------------------------
# images: bad inputs
# ----------------------------------------------------------------------------------------------------------------


def test_image_empty_bytes_and_empty_file(tmp_path):
    media_error(load_image, b"", kinds="empty")
    path = tmp_path / "empty.png"
    path.write_bytes(b"")
    err = media_error(load_image, str(path), kinds="empty")
    assert err.source == str(path)


@pytest.mark.parametrize("fixture", ["png_bytes", "jpeg_bytes"])
@pytest.mark.parametrize("frac", [0.5, 0.1, 0.9])
def test_image_truncated(request, fixture, frac):
    data = request.getfixturevalue(fixture)
    media_error(load_image, data[: int(len(data) * frac)], kinds="truncated")


def test_image_truncated_from_path_keeps_source(tmp_path, png_bytes):
    path = tmp_path / "cut.png"
    path.write_bytes(png_bytes[: len(png_bytes) // 2])
    err = media_error(load_image, str(path), kinds="truncated")
    assert err.source == str(path) and str(path) in str(err)


@pytest.mark.parametrize("data", [
    np.random.default_rng(1).bytes(4096),
    b"this is plain text, not an image at all\n" * 40,
    b"%PDF-1.7\n" + b"\x00" * 200,
], ids=["random", "text", "pdf"])
def test_image_not_an_image_is_unsupported(data):
    media_error(load_image, data, kinds="unsupported")


def test_png_header_then_garbage_is_corrupt():
    data = b"\x89PNG\r\n\x1a\n" + np.random.default_rng(2).bytes(2048)
    media_error(load_image, data, kinds="corrupt")


def test_png_with_damaged_pixel_data_is_corrupt(png_bytes):
    # Header intact, IDAT payload overwritten: must not decode silently.
    idat = png_bytes.index(b"IDAT")
    damaged = png_bytes[: idat + 4] + bytes(b ^ 0x5A for b in png_bytes[idat + 4:-12]) + png_bytes[-12:]
    media_error(load_image, damaged, kinds=("corrupt", "truncated"))


def test_huge_declared_dimensions_are_refused_before_decoding():
    # ~81 Mpx: below Pillow's own bomb threshold, above our 64 Mpx default -> our check, before any allocation.
    media_error(load_image, png_with_size(9000, 9000), kinds="too_large", timeout=5)
    # 400 Mpx: Pillow's DecompressionBombError path -> still too_large.
    media_error(load_image, png_with_size(20000, 20000), kinds="too_large", timeout=5)


def test_image_missing_path_and_directory(tmp_path):
    missing = tmp_path / "nope.png"
    err = media_error(load_image, str(missing), kinds="not_found")
    assert err.source == str(missing)
    media_error(load_image, f"file://{missing}", kinds="not_found")
    err = media_error(load_image, str(tmp_path), kinds="not_found")  # a folder names no media file
    assert "is a folder" in str(err)


def test_read_bytes(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"abcdef")
    assert read_bytes(str(path)) == b"abcdef"
    assert read_bytes(f"file://{path}") == b"abcdef"
    assert read_bytes(str(path), MediaLimits(max_bytes=6)) == b"abcdef"
    media_error(read_bytes, str(path), MediaLimits(max_bytes=5), kinds="too_large")
    media_error(read_bytes, str(tmp_path / "missing"), kinds="not_found")


# ----------------------------------------------------------------------------------------------------------------
# video: sampling
# ----------------------------------------------------------------------------------------------------------------


def test_uniform_indices():
    assert uniform_indices(N_FRAMES, 4) == [0, 8, 15, 23]
    assert uniform_indices(N_FRAMES, 1) == [0]
    assert uniform_indices(N_FRAMES, N_FRAMES) == list(range(N_FRAMES))
    assert uniform_indices(10, 2) == [0, 9]
    assert uniform_indices(0, 5) == []
    for total in (1, 2, 7, 24, 100):
        for n in range(1, total + 1):
            idx = uniform_indices(total, n)
            assert len(idx) == n and idx[0] == 0 and idx[-1] == (total - 1 if n > 1 else 0)
            assert all(b > a for a, b in zip(idx, idx[1:])), (total, n, idx)  # distinct when n <= total
            gaps = np.diff(idx)
            assert len(gaps) == 0 or gaps.max() - gaps.min() <= 1  # evenly spread


@pytest.mark.parametrize("n", [1, 4, 8, N_FRAMES])
def test_uniform_sampling_from_bytes(mp4, n):
    clip = bounded(load_video, mp4, num_frames=n)
    check_clip(clip, uniform_indices(N_FRAMES, n))


def test_uniform_sampling_from_path_and_file_uri(tmp_path, mp4_h264):
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4_h264)
    want = uniform_indices(N_FRAMES, 6)
    from_bytes = bounded(load_video, mp4_h264, num_frames=6)
    for src in (str(path), f"file://{path}"):
        clip = bounded(load_video, src, num_frames=6)
        check_clip(clip, want)
        for a, b in zip(clip.frames, from_bytes.frames):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_threaded_and_single_threaded_decoding_give_the_same_frames(mp4, monkeypatch):
    """Small frames decode and convert on one thread, large ones threaded (THREADED_VIDEO_PIXELS): only the speed differs."""
    one = decode_video_bytes(mp4, num_frames=6).frames
    monkeypatch.setattr(video_mod, "THREADED_VIDEO_PIXELS", 0)
    threaded = decode_video_bytes(mp4, num_frames=6).frames
    assert len(one) == 6 and [f.tobytes() for f in one] == [f.tobytes() for f in threaded]


def test_default_is_eight_uniform_frames(mp4_h264):
    check_clip(bounded(load_video, mp4_h264), uniform_indices(N_FRAMES, 8))


def test_uniform_sampling_without_declared_frame_count(mkv):
    with av.open(io.BytesIO(mkv)) as c:
        assert not c.streams.video[0].frames  # the path under test: count frames while decoding
    check_clip(bounded(load_video, mkv, num_frames=4), [0, 8, 15, 23])


@pytest.mark.parametrize("fps, indices", [
    (2.0, [0, 6, 12, 18]),  # one frame every 0.5 s
    (1.0, [0, 12]),
    (4.0, [0, 3, 6, 9, 12, 15, 18, 21]),
    (0.4, [0]),  # slower than the clip is long: just the first frame
])
def test_fps_sampling(mp4, fps, indices):
    clip = bounded(load_video, mp4, num_frames=None, fps=fps)
    check_clip(clip, indices)
    assert np.diff(clip.timestamps) == pytest.approx([1.0 / fps] * (len(indices) - 1), abs=2e-3)


def test_fps_sampling_on_a_non_integer_grid(mp4_h264):
    # fps=5: targets every 0.2 s; each pick is the first frame at or after its target (frames are 1/12 s apart).
    clip = bounded(load_video, mp4_h264, num_frames=None, fps=5.0)
    targets = [k * 0.2 for k in range(10)]
    want = [int(np.ceil(t * FPS - 1e-6)) for t in targets]
    check_clip(clip, want)
    for t, target in zip(clip.timestamps, targets):
        assert target - 1e-6 <= t < target + 1.0 / FPS


def test_fps_sampling_without_declared_frame_count(mkv):
    check_clip(bounded(load_video, mkv, num_frames=None, fps=2.0), [0, 6, 12, 18])


def test_fps_above_source_rate_gives_every_frame_once(mp4_h264):
    check_clip(bounded(load_video, mp4_h264, num_frames=None, fps=100.0), list(range(N_FRAMES)))


@pytest.mark.parametrize("fixture", ["mp4_h264", "mkv"])
def test_more_frames_than_exist(request, fixture):
    # Asking for 50 of 24 frames gives every frame exactly once, in order, whatever the container.
    clip = bounded(load_video, request.getfixturevalue(fixture), num_frames=50)
    check_clip(clip, list(range(N_FRAMES)))


def test_num_frames_and_fps_validation(mp4_h264):
    for kwargs in (dict(num_frames=4, fps=2.0),
                   dict(num_frames=0), dict(num_frames=-1), dict(num_frames=None, fps=0.0),
                   dict(num_frames=None, fps=-1.0)):
        with pytest.raises(ValueError) as ei:
            bounded(decode_video_bytes, mp4_h264, **kwargs)
        assert not isinstance(ei.value, MediaError), kwargs  # a caller mistake, not a bad input
        with pytest.raises(ValueError):
            bounded(load_video, mp4_h264, **kwargs)
    # fps alone is enough; neither gives the default of 8 uniform frames.
    assert len(bounded(load_video, mp4_h264, fps=2.0).frames) == 4
    assert len(bounded(load_video, mp4_h264).frames) == 8


# ----------------------------------------------------------------------------------------------------------------
# video: limits
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["mp4_h264", "mkv"])
def test_max_video_frames(request, fixture):
    data = request.getfixturevalue(fixture)
    assert len(bounded(load_video, data, num_frames=4, limits=MediaLimits(max_video_frames=N_FRAMES)).frames) == 4
    media_error(load_video, data, num_frames=4, limits=MediaLimits(max_video_frames=10), kinds="too_large")
    media_error(load_video, data, num_frames=None, fps=1.0, limits=MediaLimits(max_video_frames=10),
                kinds="too_large")


@pytest.mark.parametrize("fixture", ["mp4_h264", "mkv"])
def test_max_video_seconds(request, fixture):
    data = request.getfixturevalue(fixture)
    assert len(bounded(load_video, data, num_frames=2, limits=MediaLimits(max_video_seconds=3.0)).frames) == 2
    err = media_error(load_video, data, num_frames=2, limits=MediaLimits(max_video_seconds=1.0), kinds="too_large")
    assert "2.0 s" in str(err)


def test_video_max_bytes(tmp_path, mp4_h264):
    n = len(mp4_h264)
    assert len(bounded(load_video, mp4_h264, num_frames=2, limits=MediaLimits(max_bytes=n)).frames) == 2
    media_error(load_video, mp4_h264, num_frames=2, limits=MediaLimits(max_bytes=n - 1), kinds="too_large")
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4_h264)
    err = media_error(load_video, str(path), num_frames=2, limits=MediaLimits(max_bytes=n - 1), kinds="too_large")
    assert err.source == str(path)


# ----------------------------------------------------------------------------------------------------------------
# video: bad inputs
# ----------------------------------------------------------------------------------------------------------------


def test_video_empty(tmp_path):
    media_error(load_video, b"", num_frames=4, kinds="empty")
    path = tmp_path / "empty.mp4"
    path.write_bytes(b"")
    media_error(load_video, str(path), num_frames=4, kinds="empty")


@pytest.mark.parametrize("frac", [0.5, 0.9])
@pytest.mark.parametrize("mode", [dict(num_frames=4), dict(num_frames=None, fps=2.0)], ids=["uniform", "fps"])
def test_video_truncated(mp4, frac, mode):
    cut = mp4[: int(len(mp4) * frac)]
    assert mp4_box_overrun(cut)
    media_error(load_video, cut, **mode, kinds="truncated")


@pytest.mark.parametrize("frac", [0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("mode", [dict(num_frames=4), dict(num_frames=None, fps=2.0), dict(num_frames=None, fps=50.0)],
                         ids=["uniform", "fps2", "fps50"])
def test_video_truncated_faststart(mp4_faststart, frac, mode):
    # moov first: a cut file opens and part of the frames decode. It must not pass as a shorter clip.
    boxes = top_level_boxes(mp4_faststart)
    assert boxes["moov"][0] < boxes["mdat"][0]
    media_error(load_video, mp4_faststart[: int(len(mp4_faststart) * frac)], **mode, kinds="truncated")


def test_video_cut_inside_the_stream_table_is_truncated(mp4):
    # Cut exactly before the moov index (every top-level box complete, no index: also what an unfinished recording
    # looks like), or just after its header (the container opens but describes no stream yet). Both are cut-off
    # files, not corrupt ones and not audio-only or data files.
    moov_off, _ = top_level_boxes(mp4)["moov"]
    for extra in (0, 8, 24, 64):
        media_error(load_video, mp4[: moov_off + extra], num_frames=4, kinds="truncated")


def test_video_cut_to_a_few_bytes_is_truncated(mp4_h264):
    for n in (8, 10, 16, 40):
        media_error(load_video, mp4_h264[:n], num_frames=4, kinds="truncated")


def test_video_truncated_from_path_keeps_source(tmp_path, mp4_h264):
    path = tmp_path / "cut.mp4"
    path.write_bytes(mp4_h264[: len(mp4_h264) // 2])
    err = media_error(load_video, str(path), num_frames=4, kinds="truncated")
    assert err.source == str(path)


@pytest.mark.parametrize("data", [
    np.random.default_rng(3).bytes(8192),
    b"this is plain text, not a video\n" * 100,
], ids=["random", "text"])
def test_video_garbage_is_unsupported(data):
    media_error(load_video, data, num_frames=4, kinds="unsupported")


def test_mp4_ftyp_then_garbage():
    data = struct.pack(">I", 24) + b"ftypisom" + b"\x00\x00\x02\x00" + b"isomiso2" + np.random.default_rng(4).bytes(4096)
    media_error(load_video, data, num_frames=4, kinds=("corrupt", "truncated"))


def test_mp4_with_damaged_media_data_never_hangs(mp4_h264):
    # mdat payload scrambled, boxes intact: either the decoder conceals it (frames of the right shape come back)
    # or a MediaError says so; never any other exception, never a hang.
    off, size = top_level_boxes(mp4_h264)["mdat"]
    body = bytes(b ^ 0xA5 for b in mp4_h264[off + 8: off + size])
    damaged = mp4_h264[: off + 8] + body + mp4_h264[off + size:]
    try:
        clip = bounded(load_video, damaged, num_frames=4)
    except MediaError as e:
        assert e.kind in ("corrupt", "truncated")
    else:
        assert all(f.size == (W, H) and f.mode == "RGB" for f in clip.frames)


@pytest.mark.parametrize("fmt", ["wav", "mp4"])
def test_audio_only_is_unsupported(fmt):
    data = make_audio(fmt)
    with av.open(io.BytesIO(data)) as c:
        assert c.streams.audio and not c.streams.video
    err = media_error(load_video, data, num_frames=4, kinds="unsupported")
    assert "no video stream" in str(err)


@pytest.mark.parametrize("fixture", ["png_bytes", "jpeg_bytes"])
def test_image_given_as_video_is_unsupported(request, fixture):
    err = media_error(load_video, request.getfixturevalue(fixture), num_frames=4, kinds="unsupported")
    assert "image" in str(err)


def test_video_missing_path(tmp_path):
    missing = tmp_path / "nope.mp4"
    err = media_error(load_video, str(missing), num_frames=4, kinds="not_found")
    assert err.source == str(missing)
    media_error(load_video, f"file://{missing}", num_frames=4, kinds="not_found")


def test_mp4_box_overrun(mp4_h264):
    assert mp4_box_overrun(mp4_h264) is False
    assert mp4_box_overrun(mp4_h264[:-1]) is True
    assert mp4_box_overrun(mp4_h264[: len(mp4_h264) // 2]) is True
    assert mp4_box_overrun(mp4_h264[:8]) is True  # the ftyp box claims more than 8 bytes
    assert mp4_box_overrun(mp4_h264[:4]) is False  # too short to tell
    assert mp4_box_overrun(b"RIFF" + b"\x00" * 100) is False  # not an mp4
    assert mp4_box_overrun(b"") is False
    # 64-bit "largesize" boxes
    ftyp = struct.pack(">I", 16) + b"ftypisom" + b"\x00\x00\x02\x00"
    big = struct.pack(">I", 1) + b"mdat" + struct.pack(">Q", 16 + 100) + b"\x00" * 100
    assert mp4_box_overrun(ftyp + big) is False
    assert mp4_box_overrun(ftyp + big[:-1]) is True


# ----------------------------------------------------------------------------------------------------------------
# S3 (moto server on loopback, read through pyarrow's S3FileSystem)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_media(s3_server, png_bytes, mp4_h264):
    bucket = s3_server.new_bucket("media")
    return {
        "bucket": bucket,
        "image": s3_server.put(bucket, "images/a.png", png_bytes),
        "video": s3_server.put(bucket, "clips/a.mp4", mp4_h264),
        "cut": s3_server.put(bucket, "clips/cut.mp4", mp4_h264[: len(mp4_h264) // 2]),
        "empty": s3_server.put(bucket, "images/empty.png", b""),
    }


def test_s3_image(s3_server, s3_media, rgb_array):
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    img = bounded(load_image, s3_media["image"], s3=s3_server.s3_config)
    assert img.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(img), rgb_array)


def test_s3_video(s3_server, s3_media):
    clip = bounded(load_video, s3_media["video"], num_frames=4, s3=s3_server.s3_config)
    check_clip(clip, [0, 8, 15, 23])
    clip = bounded(load_video, s3_media["video"], num_frames=None, fps=2.0, s3=s3_server.s3_config)
    check_clip(clip, [0, 6, 12, 18])


def test_s3_read_bytes_roundtrip(s3_server, s3_media, png_bytes):
    assert bounded(read_bytes, s3_media["image"], s3=s3_server.s3_config) == png_bytes


def test_s3_config_from_env(s3_server, s3_media, rgb_array, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    cfg = S3Config.from_env()
    assert cfg == s3_server.s3_config
    img = bounded(load_image, s3_media["image"])  # no explicit config: read from the environment
    np.testing.assert_array_equal(np.asarray(img), rgb_array)


def test_s3_missing_key_and_bucket(s3_server, s3_media):
    cfg = s3_server.s3_config
    uri = f"s3://{s3_media['bucket']}/images/missing.png"
    err = media_error(load_image, uri, s3=cfg, kinds="not_found")
    assert err.source == uri
    media_error(load_video, f"s3://{s3_media['bucket']}/clips/missing.mp4", num_frames=4, s3=cfg, kinds="not_found")
    media_error(load_image, "s3://no-such-bucket-mmspec/a.png", s3=cfg, kinds="not_found")


def test_s3_limits_and_bad_objects(s3_server, s3_media, png_bytes):
    cfg = s3_server.s3_config
    media_error(load_image, s3_media["image"], MediaLimits(max_bytes=len(png_bytes) - 1), s3=cfg, kinds="too_large")
    media_error(load_image, s3_media["empty"], s3=cfg, kinds="empty")
    err = media_error(load_video, s3_media["cut"], num_frames=4, s3=cfg, kinds="truncated")
    assert err.source == s3_media["cut"]


def test_damaged_video_errors_say_what_to_do_without_ffmpeg_errno_text():
    from mmspec_ray.toy.clips import encode_mp4
    from tiny import random_images

    clip = encode_mp4(random_images(8, seed=2), fps=8)
    for data, kind, hint in ((clip[: len(clip) // 2], "truncated", "upload the whole file again"),
                             (b"\x1a\x45\xdf\xa3" + bytes(500), "corrupt", "re-encode the file")):
        with pytest.raises(MediaError) as e:
            load_video(data)
        assert e.value.kind == kind and hint in str(e.value), str(e.value)
        assert "Errno" not in str(e.value) and "<none>" not in str(e.value), str(e.value)
