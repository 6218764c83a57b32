"""Batch layer without Ray: row validation and media errors, SpecDecoder.decode == SpecEngine, output blocks,
resume bookkeeping, summary, Kinetics CSV rows, job spec and flags."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmspec_ray.batch import DecodeConfig, JobSpec, SpecDecoder
from mmspec_ray.batch.cli import build_parser, plan
from mmspec_ray.batch.decoder import attach_outputs
from mmspec_ray.batch.rows import OUTPUT_COLUMNS, OUTPUT_SCHEMA, RowError, prepare_row
from mmspec_ray.batch.sources import kinetics_rows
from mmspec_ray.batch.stages import keep_ids, prepare_block
from mmspec_ray.batch.output import scan as scan_output
from mmspec_ray.batch.storage import check_ids, locate
from mmspec_ray.batch.summary import format_summary, row_stats, summarize
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.config import S3Config, SamplingParams
from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.media import load_image, load_video
from mmspec_ray.decoding.engine import SpecEngine
from mmspec_ray.targets import Request, load_target
from mmspec_ray.toy.clips import encode_mp4
from tiny import random_images

MAX_NEW = 12
LOCAL = S3Config(region="us-east-1")


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def corrupt_png() -> bytes:
    """A real PNG with its pixel data zeroed in the middle."""
    data = png(random_images(1, seed=11)[0])
    return data[:100] + bytes(200) + data[300:]


@pytest.fixture(scope="module")
def cfg(ckpt):
    return DecodeConfig(target=ckpt, drafter="ngram", max_new_tokens=MAX_NEW, media={"num_frames": 4}, s3=LOCAL)


@pytest.fixture(scope="module")
def decoder(cfg):
    return SpecDecoder(cfg)


@pytest.fixture(scope="module")
def clip_bytes():
    return encode_mp4(random_images(8, seed=5), fps=8)


# ---------------- rows ----------------

def test_prepare_row_decodes_every_media_field(cfg, clip_bytes, tmp_path):
    img = random_images(1, seed=3)[0]
    (tmp_path / "a.png").write_bytes(png(img))
    req = prepare_row({"id": "a", "prompt": "p", "image_uri": str(tmp_path / "a.png"), "video": clip_bytes}, cfg)
    assert req.prompt == "p" and len(req.images) == 1 and len(req.videos) == 1 and len(req.videos[0]) == 4
    assert req.images[0].tobytes() == img.tobytes()
    two = prepare_row({"id": "b", "prompt": "p", "image": [png(img), png(img)]}, cfg)
    assert len(two.images) == 2


@pytest.mark.parametrize("row, field, kind", [
    ({"prompt": None, "image": None}, "prompt", "null_field"),
    ({"prompt": 3}, "prompt", "invalid"),
    ({"image": None}, "prompt", "missing_field"),
    ({"prompt": "p", "image": corrupt_png()}, "image", "media.corrupt"),
    ({"prompt": "p", "image_uri": "/no/such/file.png"}, "image_uri", "media.not_found"),
    ({"prompt": "p", "image": "/a/path.png"}, "image", "invalid"),
    ({"prompt": "p", "image_uri": ""}, "image_uri", "invalid"),
    ({"prompt": "p", "image": b"x", "image_uri": "/x.png"}, "image", "invalid"),
    ({"prompt": "p", "image": [None]}, "image[0]", "null_field"),
    ({"messages": "{not json"}, "messages", "invalid"),
])
def test_prepare_row_errors_name_the_field(cfg, row, field, kind):
    with pytest.raises(RowError) as e:
        prepare_row({"id": "x", **row}, cfg)
    assert e.value.field == field and e.value.kind == kind
    assert str(e.value).startswith(f"{field}: ")


def test_truncated_clip_and_required_media(cfg, clip_bytes):
    with pytest.raises(RowError) as e:
        prepare_row({"id": "x", "prompt": "p", "video": clip_bytes[: len(clip_bytes) // 2]}, cfg)
    assert (e.value.field, e.value.kind) == ("video", "media.truncated")
    need_video = cfg.model_copy(update={"media": cfg.media.model_copy(update={"require": "video"})})
    with pytest.raises(RowError) as e:
        prepare_row({"id": "x", "prompt": "p", "video_uri": None}, need_video)
    assert (e.value.field, e.value.kind) == ("video_uri", "null_field")
    with pytest.raises(RowError) as e:
        prepare_row({"id": "x", "prompt": "p"}, need_video)
    assert e.value.kind == "missing_field"
    with pytest.raises(RowError, match="video_uri: is an empty list; this job needs a video per row") as e:
        prepare_row({"id": "x", "prompt": "p", "video_uri": []}, need_video)


def test_uris_that_name_no_file_and_images_over_the_jobs_pixel_limit(cfg, tmp_path):
    """A folder or a bare `s3://` is no media file: not_found / invalid, naming the field, never an I/O error; an
    image over the job's max_image_pixels is refused quoting that limit, also where Pillow's own guard fires."""
    (tmp_path / "folder").mkdir()
    cases = [(str(tmp_path / "folder"), "media.not_found", "is a folder"),
             ("s3://", "invalid", "names no object"), ("s3://bucket", "invalid", "names no object"),
             ("s3://bucket/prefix/", "invalid", "names no object")]
    for uri, kind, text in cases:
        with pytest.raises(RowError, match=text) as e:
            prepare_row({"id": "x", "prompt": "p", "image_uri": uri}, cfg)
        assert (e.value.field, e.value.kind) == ("image_uri", kind), uri
    big = Image.new("L", (12000, 12000))  # 144 M pixels: over Pillow's own guard (89 M) and the default 64 M
    buf = io.BytesIO()
    big.save(buf, "PNG")
    with pytest.raises(RowError, match=r"144000000 pixels > limit 64000000 \(media.limits.max_image_pixels\)") as e:
        prepare_row({"id": "x", "prompt": "p", "image": buf.getvalue()}, cfg)
    assert e.value.kind == "media.too_large"
    low = cfg.model_copy(update={"media": cfg.media.model_copy(update={"limits": cfg.media.limits.model_copy(
        update={"max_image_pixels": 1000})})})
    with pytest.raises(RowError, match=r"1600 pixels > limit 1000|40x40 pixels > limit 1000"):
        prepare_row({"id": "x", "prompt": "p", "image": png(random_images(1, seed=2, size=40)[0])}, low)


def test_default_prompt_and_messages(cfg):
    with_default = cfg.model_copy(update={"default_prompt": "caption it"})
    assert prepare_row({"id": "x"}, with_default).prompt == "caption it"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert prepare_row({"id": "x", "messages": json.dumps(msgs)}, cfg).messages == msgs


def test_sampling_seed_depends_only_on_seed_and_id(cfg):
    hot = cfg.model_copy(update={"temperature": 0.7, "seed": 1})
    assert hot.sampling_for("a") == hot.sampling_for("a") != hot.sampling_for("b")
    assert cfg.sampling_for("a") == SamplingParams(temperature=0.0)  # greedy, whatever the checkpoint's defaults


# ---------------- decoder ----------------

def test_decode_equals_spec_engine_for_that_row_alone(ckpt, decoder, clip_bytes):
    target = load_target(ckpt)
    engine = SpecEngine(target, load_drafter("ngram", target))
    img = random_images(1, seed=7)[0]
    cases = [
        ({"id": "i", "prompt": "describe the image", "image": png(img)},
         Request(prompt="describe the image", images=(load_image(png(img)),))),
        ({"id": "v", "prompt": "what is happening", "video": clip_bytes},
         Request(prompt="what is happening", videos=(tuple(load_video(clip_bytes, num_frames=4).frames),))),
        ({"id": "t", "prompt": "red blue"}, Request(prompt="red blue")),
    ]
    for row, request in cases:
        want = engine.generate(request, SamplingParams(), MAX_NEW)
        got = decoder.decode(row)
        assert got["error"] is None, got
        assert got["output_token_ids"] == want.token_ids and got["output_text"] == want.text
        assert got["num_output_tokens"] == MAX_NEW and got["finish_reason"] == "length"
        assert got["decode_seconds"] > 0 and got["accepted_per_cycle"] >= 0


def test_over_long_prompt_is_a_row_error(decoder):
    out = decoder.decode({"id": "long", "prompt": "red " * 10_000})
    assert out["error_kind"] == "too_long" and out["error"].startswith("prompt: too long")
    assert out["output_text"] is None and set(out) == set(OUTPUT_COLUMNS)


def test_a_typed_image_placeholder_is_an_invalid_row_naming_the_field(decoder):
    """It was filed as kind internal with the processor's raw ValueError."""
    out = decoder.decode({"id": "p", "prompt": "describe <image> here", "image": png(random_images(1, seed=3)[0])})
    assert out["error_kind"] == "invalid" and out["output_text"] is None, out
    assert out["error"].startswith("prompt contains the image placeholder token '<image>'; remove it"), out


def test_messages_with_plain_string_content_and_an_image_column_decode_like_a_prompt(decoder):
    """The most common OpenAI shape (content a plain string, the image in its own column) failed with the
    processor's ValueError, filed as internal; `[{"foo": 1}]` failed in the chat template, also internal."""
    img = png(random_images(1, seed=4)[0])
    want = decoder.decode({"id": "p", "prompt": "describe the image", "image": img})
    for messages in ([{"role": "user", "content": "describe the image"}],
                     json.dumps([{"role": "user", "content": "describe the image"}])):
        got = decoder.decode({"id": "m", "messages": messages, "image": img})
        assert got["error"] is None and got["output_token_ids"] == want["output_token_ids"], got
    bad = decoder.decode({"id": "f", "messages": [{"foo": 1}], "image": img})
    assert bad["error_kind"] == "invalid" and bad["error"].startswith("messages[0].role: "), bad


def test_call_on_raw_and_prepared_blocks(decoder, cfg):
    img = png(random_images(1, seed=9)[0])
    block = pa.Table.from_pylist([
        {"id": "a", "prompt": "describe", "image": img, "extra": 1},
        {"id": "b", "prompt": None, "image": img, "extra": 2},
    ])
    raw = decoder(block)
    prepared = decoder(prepare_block(block, cfg))
    for out in (raw, prepared):
        assert out.column_names == block.column_names + list(OUTPUT_COLUMNS)
        assert out.schema.field("output_token_ids").type == OUTPUT_SCHEMA.field("output_token_ids").type
        assert out.column("extra").to_pylist() == [1, 2]
        assert out.column("error_kind").to_pylist() == [None, "null_field"]
    assert raw.column("output_token_ids").to_pylist() == prepared.column("output_token_ids").to_pylist()


def test_all_error_block_keeps_types():
    block = pa.table({"id": ["a"], "prompt": pa.array([None], pa.string())})
    out = attach_outputs(block, [{c: None for c in OUTPUT_COLUMNS} | {"error": "prompt: is null"}])
    assert out.schema.field("num_output_tokens").type == pa.int32()


def not_utf8(values: list[bytes | None], large: bool = False) -> pa.Array:
    """A string column holding the given bytes as they are (Arrow and parquet keep invalid UTF-8 as read)."""
    return pa.array(values, pa.large_binary() if large else pa.binary()).view(pa.large_string() if large else
                                                                             pa.string())


def test_text_that_is_not_utf8_fails_its_row_only(decoder, cfg, tmp_path):
    """A binary value in a string column (prompt, id, a list of strings) is that row's `invalid` error; the block's
    other rows are answered. A non-UTF-8 id is written, and compared on resume, with its invalid bytes as \\xNN
    escapes (`id-\\xff`), the same in the input's scan, `keep_ids` and the output."""
    from mmspec_ray.batch.storage import scan_input

    img = png(random_images(1, seed=9)[0])
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "id": not_utf8([b"good", b"bad-prompt", b"id-\xff", b"bad-tag"]),
        "prompt": not_utf8([b"describe", b"caf\xe9 \xff", b"describe", b"describe"], large=True),
        "image": [img] * 4,
        "tags": pa.array([[b"x"], [b"y"], None, [b"ok", b"\xfe"]], pa.list_(pa.binary())).view(pa.list_(pa.string())),
    }), path)
    block = pq.read_table(path)
    with pytest.raises(UnicodeDecodeError):
        block.to_pylist()
    _, ids = scan_input(locate(str(path), LOCAL))
    assert ids.to_pylist() == ["good", "bad-prompt", "id-\\xff", "bad-tag"]
    assert keep_ids(block, pa.array(["id-\\xff", "good"])).num_rows == 2
    raw = decoder(block)
    prepared = decoder(prepare_block(block, cfg))
    for out in (raw, prepared):
        rows = out.to_pylist()  # readable: every string is valid UTF-8 now
        assert [r["id"] for r in rows] == ids.to_pylist()
        assert [r["error_kind"] for r in rows] == [None, "invalid", "invalid", "invalid"]
        assert rows[0]["output_text"] and rows[0]["error"] is None
        assert rows[1]["error"].startswith("prompt: is not valid UTF-8") and rows[1]["prompt"] == "caf\\xe9 \\xff"
        assert rows[2]["error"].startswith("id: is not valid UTF-8 text (the row's id is written as 'id-\\xff')")
        assert rows[3]["error"].startswith("tags: holds text that is not valid UTF-8") and rows[3]["tags"] is None
    assert raw.column("output_token_ids").to_pylist() == prepared.column("output_token_ids").to_pylist()


# ---------------- resume bookkeeping and summary ----------------

def test_keep_ids_and_check_ids():
    t = pa.table({"id": ["a", "b", "c"], "x": [1, 2, 3]})
    assert keep_ids(t, pa.array(["c", "a"])).column("x").to_pylist() == [1, 3]
    with pytest.raises(ValueError, match="null id"):
        check_ids(pa.array(["a", None]), "in")
    with pytest.raises(ValueError, match="duplicated ids"):
        check_ids(pa.array(["a", "b", "a"]), "in")


def test_scan_output_drops_torn_parts(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    W = "0" * 32  # a write id: parts are named mmspec-part-<run>_<write id>_<task>-<file>.parquet
    pq.write_table(pa.table({"id": ["a", "b"], "v": [1, 2]}), out / f"mmspec-part-ab12_{W}_000000-0.parquet")
    good = io.BytesIO()
    pq.write_table(pa.table({"id": ["c"], "v": [3]}), good)
    torn = good.getvalue()[:-20]  # a write cut off by a crash
    (out / f"mmspec-part-ab12_{W}_000001-0.parquet").write_bytes(torn)
    (out / "users-own.parquet").write_bytes(torn)  # not the job's: never read, never deleted
    (out / "_summary.json").write_text("{}")
    state, table = scan_output(locate(str(out), LOCAL), {"runs": ["ab12"]}, ["v"])
    assert sorted(state.ids.to_pylist()) == ["a", "b"] and table.column("v").to_pylist() == [1, 2]
    assert [p.endswith(f"mmspec-part-ab12_{W}_000001-0.parquet") for p in state.removed] == [True]
    assert not (out / f"mmspec-part-ab12_{W}_000001-0.parquet").exists() and (out / "_summary.json").exists()
    assert (out / "users-own.parquet").read_bytes() == torn
    assert [p.endswith("users-own.parquet") for p in state.foreign] == [True]


def test_summary_counts():
    out = pa.table({"id": ["a", "b", "c", "c"], "error_kind": [None, "media.corrupt", None, None],
                    "num_output_tokens": pa.array([4, None, 6, 6], pa.int32()),
                    "accepted_per_cycle": [1.0, None, 2.0, 2.0], "decode_seconds": [0.5, None, 0.5, 0.5]})
    s = summarize(out, pa.array(["a", "b", "c", "d"]), pa.array(["b", "c"]), 2.0, {"input": "x"})
    assert (s["rows"], s["rows_written"], s["duplicates"], s["missing"], s["complete"]) == (4, 4, 1, 1, False)
    assert s["skipped_already_done"] == 2 and s["run"]["rows"] == 3 and s["run"]["output_tokens_per_s"] == 6.0
    assert row_stats(out)["errors_by_kind"] == {"media.corrupt": 1} == s["all_rows"]["errors_by_kind"]
    progress = {"rows": 10, "tokens": 100, "first_report_s": 5.0, "last_report_s": 7.0, "first_rows": 2,
                "first_tokens": 20}
    s = summarize(out, pa.array(["a"]), pa.array(["a"]), 2.0, {}, progress)
    assert (s["run"]["startup_seconds"], s["run"]["steady_rows_per_s"], s["run"]["steady_output_tokens_per_s"]) == (
        5.0, 4.0, 40.0)
    assert s["run"]["speedup_vs_ar"] is None and "measured speedup" not in format_summary(s)
    assert "no speedup over AR measured" not in format_summary(s)  # no sample asked for
    s = summarize(out, pa.array(["a"]), pa.array(["a"]), 2.0, {"speedup_sample": 8, "drafter": "ngram"}, progress)
    assert "no speedup over AR measured this run: its rows decoded while the draft tree was being calibrated" in \
        format_summary(s)
    progress["speedup_samples"] = [{"spec_s": 1.0, "spec_tokens": 10, "ar_s": 3.0, "ar_tokens": 10, "same": True},
                                   {"spec_s": 1.0, "spec_tokens": 20, "ar_s": 2.0, "ar_tokens": 10, "same": False}]
    s = summarize(out, pa.array(["a"]), pa.array(["a"]), 2.0, {}, progress)
    assert s["run"]["speedup_vs_ar"] == {"rows": 2, "speedup": pytest.approx((5.0 / 20) / (2.0 / 30)),
                                         "greedy_rows": 2, "greedy_identical": 1}
    assert ("measured speedup over AR decoding 3.75x on 2 rows decoded both ways; greedy answers identical to AR on "
            "1/2") in format_summary(s)


def test_a_few_rows_are_decoded_with_ar_too_for_the_measured_speedup(cfg):
    dec = SpecDecoder(cfg.model_copy(update={"tree": TreeConfig(top_k=2, depth=3, total_tokens=6),
                                             "speedup_sample": 1}))
    rows = [{"id": i, "prompt": p} for i, p in enumerate(["red blue red blue", "blue circle", "a b c"])]
    outs = [dec.decode(r) for r in rows]
    assert all(o["error"] is None for o in outs)
    assert len(dec.samples) == 1 and dec.ar_left == 0  # one row: the second (the first runs cold)
    (sample,) = dec.samples
    assert sample["same"] is True and sample["ar_tokens"] == sample["spec_tokens"] == outs[1]["num_output_tokens"]
    assert sample["ar_s"] > 0 and sample["spec_s"] == outs[1]["decode_seconds"]


def test_the_speedup_sample_alternates_which_decode_runs_first_across_reports(cfg):
    """Every other sampled row runs its AR decode first (the second decode of a request finds warm caches), counted
    over the decoder's life: a block's report, which empties `samples`, does not reset it. Every 4th settled row is
    sampled."""
    dec = SpecDecoder(cfg.model_copy(update={"tree": TreeConfig(top_k=2, depth=3, total_tokens=6),
                                             "speedup_sample": 3}))
    order: list[str] = []
    ar_decode, generate = dec._ar_decode, dec.engine.generate
    dec._ar_decode = lambda *a: (order.append("ar"), ar_decode(*a))[1]
    dec.engine.generate = lambda *a, **k: (order.append("spec"), generate(*a, **k))[1]
    sampled = []
    for i in range(12):
        before = len(order)
        assert dec.decode({"id": i, "prompt": f"red blue {i}"})["error"] is None
        if len(order) - before == 2:
            sampled.append((i, order[before]))
        dec.samples = []  # what a block's report does
    assert sampled == [(1, "spec"), (5, "ar"), (9, "spec")]


# ---------------- inputs, spec, flags ----------------

def test_kinetics_csv_rows(tmp_path):
    csv = tmp_path / "val.csv"
    csv.write_text('label,youtube_id,time_start,time_end,split\n"air drumming",-3B32lodo2M,59,69,val\n'
                   "abseiling,0123456789,5,15,val\n")
    t = kinetics_rows(str(csv), str(tmp_path / "clips"), "Describe.", LOCAL)
    assert t.column("id").to_pylist() == ["-3B32lodo2M_000059_000069", "0123456789_000005_000015"]
    assert t.column("video_uri")[1].as_py() == str(tmp_path / "clips" / "0123456789_000005_000015.mp4")
    assert t.column("label").to_pylist() == ["air drumming", "abseiling"] and t.column("prompt")[0].as_py() == "Describe."


def test_job_spec_yaml_and_flags(tmp_path, ckpt):
    (tmp_path / "job.yaml").write_text(
        f"input: {tmp_path}/in.parquet\noutput: s3://b/out/\ndecode:\n  target: {ckpt}\n  max_new_tokens: 7\n")
    spec = JobSpec.from_yaml(tmp_path / "job.yaml", num_actors=2)
    assert spec.num_actors == 2 and spec.decode.max_new_tokens == 7 and spec.decode.drafter == "auto"
    args = build_parser("instruct").parse_args(
        ["--config", str(tmp_path / "job.yaml"), "--temperature", "0.5", "--gpus-per-actor", "1", "--limit", "3",
         "--s3-endpoint", "http://127.0.0.1:9000", "--drafter", "none"])
    spec, table, _ = plan("instruct", args)
    assert table is None and spec.limit == 3 and spec.gpus_per_actor == 1
    d = spec.decode
    assert (d.temperature, d.max_new_tokens, d.drafter, d.media.require) == (0.5, 7, "none", "image")
    assert (d.s3.endpoint_override, d.s3.scheme) == ("127.0.0.1:9000", "http")
    with pytest.raises(ValueError):
        JobSpec.model_validate({"input": "a", "output": "b", "decode": {"target": ckpt}, "bogus": 1})


def test_a_drafter_that_pays_on_some_rows_drafts_them_and_the_summary_says_what_the_guard_did(cfg, tmp_path):
    """The user's walk in small: a suffix drafter that knows the answers of 5 of 24 rows of one kind (never the
    first, never a multiple of 8), decoded under the payoff guard with answers running to max_new_tokens. The rows it
    knows draft and accept (tokens per target forward well above 1, counted, not timed), the guard's record is in
    every row, and the summary says what it did."""
    from mmspec_ray.decoding.engine import AREngine
    from mmspec_ray.drafters.suffix import SuffixConfig, SuffixDrafter

    target = load_target(cfg.target, device="cpu")
    prompts = [f"item {i}: describe the {w} shape" for i, w in enumerate(["red", "blue", "round", "tall"] * 6)]
    known = {1, 5, 11, 18, 22}
    answers = {i: AREngine(target).generate(Request(prompt=prompts[i]), max_new_tokens=32).token_ids for i in known}
    drafter = SuffixDrafter.save(tmp_path / "suffix", list(answers.values()),
                                 SuffixConfig(target_vocab_size=target.vocab_size))
    dec = SpecDecoder(cfg.model_copy(update={"drafter": str(drafter), "max_new_tokens": 32, "payoff_guard": True,
                                             "tree": TreeConfig(top_k=2, depth=6, total_tokens=12)}))
    outs = [dec.decode({"id": i, "prompt": p}) for i, p in enumerate(prompts)]
    assert all(o["error"] is None and o["payoff_guard"] in ("drafted", "fell_back", "held", "warm_up") for o in outs)
    for i in known:
        o = outs[i]
        assert o["output_token_ids"] == answers[i]  # lossless, as ever
        assert o["num_output_tokens"] / o["verify_cycles"] >= 2.5, (i, o["num_output_tokens"], o["verify_cycles"],
                                                                  o["payoff_guard"])
    table = attach_outputs(pa.table({"id": list(range(len(prompts)))}), outs)
    s = summarize(table, table.column("id").combine_chunks(), table.column("id").combine_chunks(), 1.0, {})
    g = s["run"]["payoff_guard"]
    assert g["rows"] == len(prompts) and sum(g["rows_by_outcome"].values()) == len(prompts)
    assert g["plain_cycles"] == sum(o["guard_plain_cycles"] for o in outs) and g["cycles"] == sum(o["verify_cycles"]
                                                                                                  for o in outs)
    assert f"/{len(prompts)} rows drafted throughout" in format_summary(s)
