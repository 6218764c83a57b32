"""The Ray Data pipeline end to end against a real S3 endpoint on loopback (moto): input parquet, media and output
all on S3. Bad rows of every kind, resume after an interrupted run, an actor killed mid-job, the Kinetics CSV job.

Every good row's text must equal what SpecEngine gives for that row alone (greedy), and every input row must be in
the output exactly once. One Ray instance for the module (2 CPUs, no dashboard), shut down at the end.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

from mmspec_ray.batch import JobSpec, SpecDecoder, run_job  # noqa: E402
from mmspec_ray.batch.cli import main as job_main  # noqa: E402
from mmspec_ray.batch.rows import prepare_row  # noqa: E402
from mmspec_ray.batch.storage import JobInputError, locate, parquet_files, read_json  # noqa: E402
from mmspec_ray.config import SamplingParams  # noqa: E402
from mmspec_ray.drafters.base import load_drafter  # noqa: E402
from mmspec_ray.media import load_image, load_video  # noqa: E402
from mmspec_ray.decoding.engine import SpecEngine  # noqa: E402
from mmspec_ray.targets import Request, load_target  # noqa: E402
from mmspec_ray.toy.clips import encode_mp4  # noqa: E402
from tiny import random_images  # noqa: E402

MAX_NEW = 10
FRAMES = 4

# The fault-injecting decoders below live in this test module, which Ray workers cannot import: ship by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def reference(ckpt):
    """What SpecEngine (greedy, n-gram drafter) gives for one request on its own."""
    target = load_target(ckpt)
    engine = SpecEngine(target, load_drafter("ngram", target))

    def run(request: Request) -> list[int]:
        return engine.generate(request, SamplingParams(), MAX_NEW).token_ids

    return run


def spec_for(s3_server, ckpt, input_uri: str, output_uri: str, **kw) -> JobSpec:
    return JobSpec.model_validate({
        "input": input_uri, "output": output_uri, "progress_bars": False, "progress_interval_s": 5,
        "rows_per_block": 2, "rows_per_file": None, **kw,
        "decode": {"target": ckpt, "drafter": "ngram", "max_new_tokens": MAX_NEW, "media": {"num_frames": FRAMES},
                   "s3": s3_server.s3_config.model_dump()},
    })


def put_parquet(s3_server, bucket: str, key: str, rows: list[dict], schema: pa.Schema | None = None) -> str:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf)
    return s3_server.put(bucket, key, buf.getvalue())


def read_output(s3_server, uri: str) -> pa.Table:
    """Every part the job wrote (files of its own naming only)."""
    loc = locate(uri, s3_server.s3_config)
    parts = [f for f in parquet_files(loc) if f.rsplit("/", 1)[-1].startswith("mmspec-part-")]
    return pa.concat_tables([pq.read_table(f, filesystem=loc.fs) for f in parts])


def image_rows(s3_server, bucket: str, n: int, seed: int) -> tuple[list[dict], dict[str, Request]]:
    """n good rows, half with image bytes, half with an s3:// image_uri; and each row's reference request."""
    rows, requests = [], {}
    for i, img in enumerate(random_images(n, seed=seed)):
        rid = f"img-{seed}-{i}"
        data = png(img)
        uri = s3_server.put(bucket, f"media/{rid}.png", data) if i % 2 else None
        rows.append({"id": rid, "prompt": f"describe the image {i}", "image": None if uri else data,
                     "image_uri": uri, "n": i})
        requests[rid] = Request(prompt=f"describe the image {i}", images=(load_image(data),))
    return rows, requests


ROW_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("image", pa.binary()),
                        ("image_uri", pa.string()), ("video", pa.binary()), ("video_uri", pa.string()),
                        ("n", pa.int64())])


def assert_exactly_once(out: pa.Table, ids: list[str]) -> None:
    got = out.column("id").to_pylist()
    assert len(got) == len(ids) and sorted(got) == sorted(ids), "every input row exactly once"


def assert_matches_reference(out: pa.Table, requests: dict[str, Request], reference) -> None:
    for row in out.to_pylist():
        if row["id"] in requests:
            assert row["error"] is None, row["error"]
            assert row["output_token_ids"] == reference(requests[row["id"]]), row["id"]
            assert row["num_output_tokens"] == MAX_NEW and row["finish_reason"] == "length"


# ---------------- bad rows of every kind, everything on S3 ----------------

def test_s3_job_with_every_kind_of_bad_row(s3_server, ray_cluster, ckpt, reference):
    b = s3_server.new_bucket("batch")
    rows, requests = image_rows(s3_server, b, 3, seed=1)
    clip = encode_mp4(random_images(8, seed=2), fps=8)
    clip_uri = s3_server.put(b, "media/clip.mp4", clip)
    frames = tuple(load_video(clip, num_frames=FRAMES).frames)
    rows += [
        {"id": "vid-bytes", "prompt": "what is happening", "video": clip, "n": 10},
        {"id": "vid-uri", "prompt": "what happens", "video_uri": clip_uri, "n": 11},
        {"id": "text-only", "prompt": "red blue circle", "n": 12},
    ]
    requests |= {"vid-bytes": Request(prompt="what is happening", videos=(frames,)),
                 "vid-uri": Request(prompt="what happens", videos=(frames,)),
                 "text-only": Request(prompt="red blue circle")}
    good_png = png(random_images(1, seed=4)[0])
    corrupt = s3_server.put(b, "media/corrupt.png", good_png[:100] + bytes(200) + good_png[300:])
    truncated = s3_server.put(b, "media/truncated.mp4", clip[: len(clip) // 2])
    bad = {
        "bad-corrupt-image": ({"prompt": "p", "image_uri": corrupt}, "image_uri", "media.corrupt"),
        "bad-truncated-clip": ({"prompt": "p", "video_uri": truncated}, "video_uri", "media.truncated"),
        "bad-missing-uri": ({"prompt": "p", "image_uri": f"s3://{b}/media/nope.png"}, "image_uri",
                            "media.not_found"),
        "bad-long-prompt": ({"prompt": "red " * 10_000, "image": good_png}, "prompt", "too_long"),
        "bad-null-prompt": ({"prompt": None, "image": good_png}, "prompt", "null_field"),
    }
    rows += [{"id": k, "n": 100 + i, **v[0]} for i, (k, v) in enumerate(bad.items())]
    src = put_parquet(s3_server, b, "in/part-0.parquet", rows, ROW_SCHEMA)
    out_uri = f"s3://{b}/out/run1/"

    summary = run_job(spec_for(s3_server, ckpt, src, out_uri))

    out = read_output(s3_server, out_uri)
    assert_exactly_once(out, [r["id"] for r in rows])
    assert out.schema.names[: len(ROW_SCHEMA)] == ROW_SCHEMA.names, "every input column kept"
    by_id = {r["id"]: r for r in out.to_pylist()}
    assert {r["id"]: r["n"] for r in rows} == {k: v["n"] for k, v in by_id.items()}
    for rid, (_, field, kind) in bad.items():
        got = by_id[rid]
        assert got["error_kind"] == kind and got["error"].startswith(f"{field}: "), (rid, got["error"])
        assert got["output_text"] is None and got["output_token_ids"] is None
    assert_matches_reference(out, requests, reference)
    assert summary["complete"] and summary["rows"] == len(rows) and summary["duplicates"] == 0
    assert summary["all_rows"]["errors_by_kind"] == {kind: 1 for _, _, kind in bad.values()}
    assert summary["run"]["output_tokens"] == MAX_NEW * len(requests)
    assert read_json(locate(out_uri, s3_server.s3_config).child("_summary.json")) == summary


# ---------------- resume after an interrupted run ----------------

class InterruptedDecoder(SpecDecoder):
    """Fails the whole job (an application error, not a row error) on the block holding `trigger`, but only once
    some output is on S3, so that the re-run has something to skip."""

    trigger = "img-3-7"
    output_uri = ""

    def __call__(self, batch):
        if self.trigger in batch.column("id").to_pylist():
            loc = locate(self.output_uri, self.config.s3)
            deadline = time.time() + 60
            while not parquet_files(loc) and time.time() < deadline:
                time.sleep(0.2)
            raise RuntimeError("simulated interruption")
        return super().__call__(batch)


def test_resume_after_interrupted_run(s3_server, ray_cluster, ckpt, reference):
    b = s3_server.new_bucket("resume")
    rows, requests = image_rows(s3_server, b, 8, seed=3)
    src = put_parquet(s3_server, b, "in/part-0.parquet", rows, ROW_SCHEMA)
    out_uri = f"s3://{b}/out/"
    spec = spec_for(s3_server, ckpt, src, out_uri)
    InterruptedDecoder.output_uri = out_uri
    with pytest.raises(Exception, match="simulated interruption"):
        run_job(spec, decoder_cls=InterruptedDecoder)
    first = read_output(s3_server, out_uri).column("id").to_pylist()
    assert 0 < len(first) < len(rows) and len(set(first)) == len(first)

    summary = run_job(spec)
    out = read_output(s3_server, out_uri)
    assert_exactly_once(out, [r["id"] for r in rows])
    assert_matches_reference(out, requests, reference)
    assert summary["complete"] and summary["skipped_already_done"] == len(first)
    assert summary["run"]["rows"] == len(rows) - len(first)

    again = run_job(spec)  # nothing left: no Ray work, same output
    assert again["complete"] and again["run"]["rows"] == 0 and again["skipped_already_done"] == len(rows)
    assert read_output(s3_server, out_uri).num_rows == len(rows)


# ---------------- on local disk, through the job's entry point: text that is not UTF-8, any parquet suffix --------

def test_local_job_answers_every_row_beside_non_utf8_text_in_files_of_any_parquet_suffix(
        s3_server, ray_cluster, ckpt, reference, tmp_path, capsys):
    """One row's prompt and another's id hold bytes that are not UTF-8: each is that row's `invalid` error (the id
    written as `id-\\xff`), every other row is answered; the files named .parquet, .PARQUET and .parq are all read.
    A resume, under other spellings of the input too, finds every row done (the escaped id included)."""
    src = tmp_path / "in"
    src.mkdir()
    rows, requests = [], {}
    for i, img in enumerate(random_images(6, seed=21)):
        data = png(img)
        rows.append({"id": f"r{i}".encode(), "prompt": f"describe the image {i}".encode(), "image": data})
        requests[f"r{i}"] = Request(prompt=f"describe the image {i}", images=(load_image(data),))
    rows[1]["prompt"] = b"describe \xff\xfe"
    rows[4]["id"] = b"id-\xff"
    del requests["r1"], requests["r4"]
    for name, chunk in (("a.parquet", rows[:2]), ("b.PARQUET", rows[2:4]), ("c.parq", rows[4:])):
        pq.write_table(pa.table({"id": pa.array([r["id"] for r in chunk]).view(pa.string()),
                                 "prompt": pa.array([r["prompt"] for r in chunk]).view(pa.string()),
                                 "image": [r["image"] for r in chunk]}), src / name)
    out = tmp_path / "out"
    flags = ["--output", str(out), "--target", ckpt, "--drafter", "ngram", "--max-new-tokens", str(MAX_NEW),
             "--num-actors", "1", "--rows-per-block", "2", "--speedup-sample", "0", "--no-progress-bars"]
    assert job_main(["--input", str(src), *flags], "instruct") == 0, capsys.readouterr().err[-2000:]
    table = read_output(s3_server, str(out))
    ids = ["r0", "r1", "r2", "r3", "id-\\xff", "r5"]
    assert_exactly_once(table, ids)
    assert_matches_reference(table, requests, reference)
    errors = {r["id"]: (r["error_kind"], r["error"]) for r in table.to_pylist() if r["error"]}
    assert set(errors) == {"r1", "id-\\xff"} and {k for k, _ in errors.values()} == {"invalid"}
    assert errors["r1"][1].startswith("prompt: is not valid UTF-8") and "'describe \\xff\\xfe'" in errors["r1"][1]
    assert errors["id-\\xff"][1].startswith("id: is not valid UTF-8 text (the row's id is written as 'id-\\xff')")
    for spelling in (str(src), f"{src}/", f"file://{src}"):
        assert job_main(["--input", spelling, *flags], "instruct") == 0, capsys.readouterr().err[-2000:]
        summary = read_json(locate(str(out), s3_server.s3_config).child("_summary.json"))
        assert summary["complete"] and summary["run"]["rows"] == 0 and summary["rows_written"] == 6, spelling
    assert read_output(s3_server, str(out)).num_rows == 6


@pytest.mark.parametrize("store", ["local", "s3"])
def test_fingerprint_media_decodes_again_the_rows_whose_media_changed(s3_server, ray_cluster, ckpt, reference,
                                                                      tmp_path, store):
    """Media replaced behind the same image_uri (a new ETag on S3, a new size or mtime on disk): with
    --fingerprint-media a resume decodes exactly those rows again, with the new media's answers; without it, none.
    The fingerprints live in the output as the job's own file, never a foreign one."""
    b = s3_server.new_bucket("mprints")
    imgs = random_images(8, seed=31)
    rows, requests, where = [], {}, {}
    for i in range(4):
        rid = f"m{i}"
        if store == "s3":
            uri = s3_server.put(b, f"media/{rid}.png", png(imgs[i]))
        else:
            path = tmp_path / "media" / f"{rid}.png"
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(png(imgs[i]))
            uri = str(path)
        where[rid] = uri
        rows.append({"id": rid, "prompt": f"describe the image {i}", "image": None, "image_uri": uri, "video": None,
                     "video_uri": None, "n": i})
        requests[rid] = Request(prompt=f"describe the image {i}", images=(load_image(png(imgs[i])),))
    src = put_parquet(s3_server, b, "in/part-0.parquet", rows, ROW_SCHEMA)
    out = f"s3://{b}/out/" if store == "s3" else str(tmp_path / "out")
    spec = spec_for(s3_server, ckpt, src, out, fingerprint_media=True)
    first = run_job(spec)
    assert first["complete"] and first["run"]["rows"] == 4 and first["media_changed_rows"] == 0
    assert "_mmspec_media.parquet" not in first["foreign_files"]
    new = png(imgs[5])  # m2's media replaced behind its URI
    if store == "s3":
        s3_server.put(b, "media/m2.png", new)
    else:
        Path(where["m2"]).write_bytes(new)
        os.utime(where["m2"], ns=(time.time_ns() + 10**9,) * 2)
    requests["m2"] = Request(prompt="describe the image 2", images=(load_image(new),))
    plain = run_job(spec.model_copy(update={"fingerprint_media": False}))
    assert plain["run"]["rows"] == 0  # without the flag the stale answer stays (as documented)
    second = run_job(spec)
    assert second["media_changed_rows"] == 1 and second["run"]["rows"] == 1 and second["complete"], second
    table = read_output(s3_server, out)
    assert_exactly_once(table, [r["id"] for r in rows])
    assert_matches_reference(table, requests, reference)
    assert run_job(spec)["run"]["rows"] == 0  # nothing changed since


# ---------------- an actor process killed mid-job ----------------

class CrashOnceDecoder(SpecDecoder):
    """Kills its own process (no cleanup, like an OOM kill) on `victim`, the first time only (marker file)."""

    victim = "img-5-4"
    marker = ""

    def generate(self, request, row_id=None):
        if row_id == self.victim and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os._exit(1)
        return super().generate(request, row_id)


def test_actor_killed_mid_job_every_row_exactly_once(s3_server, ray_cluster, ckpt, reference, tmp_path):
    b = s3_server.new_bucket("crash")
    rows, requests = image_rows(s3_server, b, 7, seed=5)
    src = put_parquet(s3_server, b, "in/part-0.parquet", rows, ROW_SCHEMA)
    out_uri = f"s3://{b}/out/"
    CrashOnceDecoder.marker = str(tmp_path / "crashed")

    summary = run_job(spec_for(s3_server, ckpt, src, out_uri), decoder_cls=CrashOnceDecoder)

    assert os.path.exists(CrashOnceDecoder.marker), "the actor really died"
    out = read_output(s3_server, out_uri)
    assert_exactly_once(out, [r["id"] for r in rows])
    assert_matches_reference(out, requests, reference)
    assert summary["complete"] and summary["all_rows"]["errors"] == 0


# ---------------- the Kinetics caption job: CSV + clip root on S3, through the job CLI ----------------

def test_caption_kinetics_job_from_csv_on_s3(s3_server, ray_cluster, ckpt, reference):
    b = s3_server.new_bucket("k400")
    clips = {}
    for i, (yid, start) in enumerate([("-3B32lodo2M", 59), ("_dbcJuKJQNs", 40)]):
        data = encode_mp4(random_images(6, seed=20 + i), fps=6)
        clips[f"{yid}_{start:06d}_{start + 10:06d}"] = data
        s3_server.put(b, f"clips/val/{yid}_{start:06d}_{start + 10:06d}.mp4", data)
    csv = ('label,youtube_id,time_start,time_end,split\n"air drumming",-3B32lodo2M,59,69,val\n'
           'abseiling,_dbcJuKJQNs,40,50,val\nabseiling,noSuchClip0,5,15,val\n')
    csv_uri = s3_server.put(b, "annotations/val.csv", csv.encode())
    out_uri = f"s3://{b}/captions/"
    rc = job_main(["--input", csv_uri, "--clip-root", f"s3://{b}/clips/val/", "--output", out_uri,
                   "--target", ckpt, "--drafter", "ngram", "--num-actors", "1", "--max-new-tokens", str(MAX_NEW),
                   "--num-frames", str(FRAMES), "--s3-endpoint", s3_server.endpoint_url, "--no-progress-bars"],
                  "caption_kinetics")
    assert rc == 0
    out = {r["id"]: r for r in read_output(s3_server, out_uri).to_pylist()}
    assert sorted(out) == sorted([*clips, "noSuchClip0_000005_000015"])
    missing = out["noSuchClip0_000005_000015"]
    assert missing["error_kind"] == "media.not_found" and missing["error"].startswith("video_uri: ")
    assert out["-3B32lodo2M_000059_000069"]["label"] == "air drumming"
    for rid, data in clips.items():
        frames = tuple(load_video(data, num_frames=FRAMES).frames)
        want = reference(Request(prompt="Describe what happens in the video.", videos=(frames,)))
        assert out[rid]["output_token_ids"] == want and out[rid]["prompt"] == "Describe what happens in the video."


# ---------------- data safety: the output is the job's, settings are recorded, outages and crashes ----------------

def s3_keys(s3_server, bucket: str) -> dict[str, bytes]:
    objs = s3_server.client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: s3_server.client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in objs}


def test_user_files_survive_and_overlapping_or_changed_jobs_are_refused(s3_server, ray_cluster, ckpt, reference):
    b = s3_server.new_bucket("safety")
    rows, requests = image_rows(s3_server, b, 3, seed=7)
    src = put_parquet(s3_server, b, "same/in.parquet", rows, ROW_SCHEMA)
    before = s3_keys(s3_server, b)
    with pytest.raises(JobInputError, match="overlap"):  # output == input prefix: refused before any write
        run_job(spec_for(s3_server, ckpt, f"s3://{b}/same/", f"s3://{b}/same/"))
    with pytest.raises(JobInputError, match="overlap"):  # output inside the (recursively read) input prefix
        run_job(spec_for(s3_server, ckpt, f"s3://{b}/same/", f"s3://{b}/same/out/"))
    user = put_parquet(s3_server, b, "mine/own.parquet", [{"name": "keep me"}])
    with pytest.raises(JobInputError, match="did not write"):  # someone's data, no job marker
        run_job(spec_for(s3_server, ckpt, src, f"s3://{b}/mine/", overwrite=True))
    assert s3_keys(s3_server, b) == before | {"mine/own.parquet": s3_keys(s3_server, b)["mine/own.parquet"]}

    out_uri = f"s3://{b}/out/"
    spec = spec_for(s3_server, ckpt, src, out_uri)
    assert run_job(spec)["complete"]
    notes = put_parquet(s3_server, b, "out/notes.parquet", [{"note": "my own file, no id column"}])
    resumed = run_job(spec)  # resume: nothing to do, the user's file is left alone
    assert resumed["complete"] and resumed["run"]["rows"] == 0 and resumed["foreign_files"] == ["notes.parquet"]
    assert "out/notes.parquet" in s3_keys(s3_server, b) and user and notes
    with pytest.raises(JobInputError, match=r"max_new_tokens: 10 -> 12"):
        run_job(spec_for(s3_server, ckpt, src, out_uri).model_copy(
            update={"decode": spec.decode.model_copy(update={"max_new_tokens": 12})}))
    with pytest.raises(JobInputError, match=r"temperature: 0.0 -> 0.8"):
        run_job(spec.model_copy(update={"decode": spec.decode.model_copy(update={"temperature": 0.8})}))
    other = run_job(spec.model_copy(update={"decode": spec.decode.model_copy(update={"drafter": "none"})}))
    assert other["complete"] and other["run"]["rows"] == 0  # greedy: a drafter change cannot change the text
    again = run_job(spec.model_copy(update={"overwrite": True}))
    assert again["run"]["rows"] == len(rows) and "out/notes.parquet" in s3_keys(s3_server, b)
    out = read_output(s3_server, out_uri)
    assert_exactly_once(out, [r["id"] for r in rows])
    assert_matches_reference(out, requests, reference)

    # the input changes under the output (same ids, new prompts; then a row fewer): a resume is refused naming
    # the file; --redecode-changed decodes the changed rows again and drops the row that left the input
    new_rows = [{**r, "prompt": f"what is in the picture {r['n']}"} for r in rows]
    put_parquet(s3_server, b, "same/in.parquet", new_rows, ROW_SCHEMA)
    with pytest.raises(JobInputError, match=r"the input changed since output .*in.parquet: .*--redecode-changed"):
        run_job(spec)
    redone = run_job(spec.model_copy(update={"redecode_changed": True}))
    assert redone["complete"] and redone["run"]["rows"] == len(rows) and redone["rows_written"] == len(rows)
    out = read_output(s3_server, out_uri)
    assert_exactly_once(out, [r["id"] for r in rows])
    assert sorted(out.column("prompt").to_pylist()) == sorted(r["prompt"] for r in new_rows)
    assert run_job(spec)["run"]["rows"] == 0  # the marker now records the new input
    put_parquet(s3_server, b, "same/in.parquet", new_rows[:2], ROW_SCHEMA)
    shrunk = run_job(spec.model_copy(update={"redecode_changed": True}))
    assert shrunk["complete"] and shrunk["rows_written"] == 2 and shrunk["other_rows"] == 0
    assert_exactly_once(read_output(s3_server, out_uri), [r["id"] for r in new_rows[:2]])
    limited = run_job(spec.model_copy(update={"limit": 1}))  # rows beyond --limit are not this run's rows
    assert limited["complete"] and (limited["rows"], limited["rows_written"], limited["other_rows"]) == (1, 1, 1)

    # a user's file named like a part, in the output: neither counted as done rows nor deleted
    put_parquet(s3_server, b, "out/mmspec-part-users_000000.parquet", [{"id": "img-7-9", "note": "mine"}])
    mine = run_job(spec)
    assert mine["complete"] and mine["rows_written"] == 2 and mine["other_rows"] == 0
    assert "mmspec-part-users_000000.parquet" in mine["foreign_files"]
    assert "out/mmspec-part-users_000000.parquet" in s3_keys(s3_server, b)


def test_s3_outage_during_media_reads_loses_no_good_row(s3_server, ray_cluster, ckpt, reference, tmp_path):
    from test_batch_safety import FlakyProxy

    b = s3_server.new_bucket("outage")
    rows, requests = image_rows(s3_server, b, 6, seed=8)  # odd rows: image_uri on S3; even rows: image bytes
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), src)
    proxy = FlakyProxy(s3_server.port)
    try:
        s3 = {"endpoint_override": f"127.0.0.1:{proxy.port}", "scheme": "http", "region": "us-east-1",
              "retries": 1, "retry_base_s": 0.1}
        spec = JobSpec.model_validate({
            "input": str(src), "output": str(tmp_path / "out"), "progress_bars": False, "rows_per_block": 2,
            "rows_per_file": None,
            "decode": {"target": ckpt, "drafter": "ngram", "max_new_tokens": MAX_NEW, "s3": s3}})
        proxy.down = True  # S3 unreachable for the whole first run
        first = run_job(spec)
        kinds = first["all_rows"]["errors_by_kind"]
        assert first["complete"] and kinds == {"media.unavailable": 3} and first["retryable_rows"] == 3, kinds
        out1 = pq.read_table(tmp_path / "out").to_pylist()
        done1 = {r["id"]: r["decode_seconds"] for r in out1 if r["error"] is None}
        proxy.down = False
        second = run_job(spec)  # the re-run retries exactly the unavailable rows
        assert second["retried_rows"] == 3 and second["run"]["rows"] == 3 and second["all_rows"]["errors"] == 0
        assert second["retryable_rows"] == 0
    finally:
        proxy.close()
    out = pq.read_table(tmp_path / "out")
    assert_exactly_once(out, [r["id"] for r in rows])
    assert_matches_reference(out, requests, reference)
    again = {r["id"]: r["decode_seconds"] for r in out.to_pylist() if r["id"] in done1}
    assert again == done1, "rows that succeeded the first time were not decoded again"


class AlwaysCrashDecoder(SpecDecoder):
    """Kills its own process every time it starts decoding `victim` (a row that always crashes native code)."""

    victim = "img-9-2"

    def _generate(self, request, row_id):
        if row_id == self.victim:
            os._exit(1)
        return super()._generate(request, row_id)


def test_row_that_always_kills_its_decoder_is_filed_as_an_error(s3_server, ray_cluster, ckpt, reference):
    b = s3_server.new_bucket("poison")
    rows, requests = image_rows(s3_server, b, 4, seed=9)
    src = put_parquet(s3_server, b, "in/part-0.parquet", rows, ROW_SCHEMA)
    summary = run_job(spec_for(s3_server, ckpt, src, f"s3://{b}/out/"), decoder_cls=AlwaysCrashDecoder)
    out = read_output(s3_server, f"s3://{b}/out/")
    assert_exactly_once(out, [r["id"] for r in rows])
    by_id = {r["id"]: r for r in out.to_pylist()}
    assert by_id["img-9-2"]["error_kind"] == "crash" and "died 2 times" in by_id["img-9-2"]["error"]
    del requests["img-9-2"]
    assert_matches_reference(out, requests, reference)
    assert summary["complete"] and summary["all_rows"]["errors_by_kind"] == {"crash": 1}


def crash_on_media(row, cfg):
    """The media stage's row function, killing its process (like a decoder segfault) on one row, every time."""
    if row["id"] == "img-10-1":
        os._exit(1)
    return prepare_row(row, cfg)


def test_row_that_kills_the_media_stage_is_filed_as_crash_then_retried_on_request(s3_server, ray_cluster, ckpt,
                                                                                 reference):
    b = s3_server.new_bucket("mediacrash")
    rows, requests = image_rows(s3_server, b, 3, seed=10)
    src = put_parquet(s3_server, b, "in/part-0.parquet", rows, ROW_SCHEMA)
    spec = spec_for(s3_server, ckpt, src, f"s3://{b}/out/")
    first = run_job(spec, row_fn=crash_on_media)
    by_id = {r["id"]: r for r in read_output(s3_server, f"s3://{b}/out/").to_pylist()}
    assert by_id["img-10-1"]["error_kind"] == "crash" and "media decoding process died 2" in by_id["img-10-1"]["error"]
    assert first["complete"] and first["all_rows"]["errors_by_kind"] == {"crash": 1}
    second = run_job(spec.model_copy(update={"retry_errors": ("crash",)}))  # --retry-errors crash
    assert second["retried_rows"] == 1 and second["run"]["rows"] == 1 and second["all_rows"]["errors"] == 0
    out = read_output(s3_server, f"s3://{b}/out/")
    assert_exactly_once(out, [r["id"] for r in rows])
    assert_matches_reference(out, requests, reference)


# ---------------- two jobs on one output ----------------

class HeldDecoder(SpecDecoder):
    """Decodes only once `go` (a local file) exists: the job holds its output while the test starts another."""

    go = ""

    def __call__(self, batch):
        deadline = time.time() + 120
        while not os.path.exists(self.go) and time.time() < deadline:
            time.sleep(0.2)
        return super().__call__(batch)


def test_two_jobs_on_one_output_one_runs_and_a_resume_drops_its_duplicates(s3_server, ray_cluster, ckpt, reference,
                                                                         tmp_path, capsys):
    """A second job on an output in use is refused in one line (exit 2) before Ray or any write; the first one
    completes. Then a state two overlapping jobs left before outputs had a lease (two runs that wrote the same
    rows), plus a user's backup of a part: a resume drops the job's own duplicate rows, one per id kept, says so,
    and neither counts nor touches the backup."""
    import threading

    from mmspec_ray.batch.lease import LEASE_NAME
    from mmspec_ray.batch.output import MARKER_NAME as MARKER
    from mmspec_ray.batch.output import read_marker, record_run

    b = s3_server.new_bucket("race")
    rows, requests = image_rows(s3_server, b, 4, seed=11)
    src = put_parquet(s3_server, b, "in/part-0.parquet", rows, ROW_SCHEMA)
    out_uri = f"s3://{b}/out/"
    spec = spec_for(s3_server, ckpt, src, out_uri)
    HeldDecoder.go = str(tmp_path / "go")
    first: dict = {}
    job_a = threading.Thread(target=lambda: first.update(summary=run_job(spec, decoder_cls=HeldDecoder)))
    job_a.start()
    out = locate(out_uri, s3_server.s3_config)
    deadline = time.time() + 120
    while time.time() < deadline and not (f"out/{MARKER}" in s3_keys(s3_server, b) and read_marker(out)["runs"]):
        time.sleep(0.2)  # the first job holds the lease, claimed the output, and waits to decode
    before = {k: v for k, v in s3_keys(s3_server, b).items() if k != f"out/{LEASE_NAME}"}
    rc = job_main(["--input", src, "--output", out_uri, "--target", ckpt, "--drafter", "ngram",
                   "--s3-endpoint", s3_server.endpoint_url, "--max-new-tokens", str(MAX_NEW)], "instruct")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "in use by another job" in err, err
    assert {k: v for k, v in s3_keys(s3_server, b).items() if k != f"out/{LEASE_NAME}"} == before
    (tmp_path / "go").touch()
    job_a.join(timeout=300)
    assert first["summary"]["complete"] and first["summary"]["run"]["rows"] == len(rows)
    assert f"out/{LEASE_NAME}" not in s3_keys(s3_server, b)  # released at the end

    parts = sorted(k for k in s3_keys(s3_server, b) if k.startswith("out/mmspec-part-"))
    other = "0ther0job0ab"  # a run of an overlapping job, which wrote the first part's rows again
    record_run(out, read_marker(out), other)
    dup = s3_keys(s3_server, b)[parts[0]]
    s3_server.put(b, f"out/mmspec-part-{other}_{'1' * 32}_000000-0.parquet", dup)
    run_a = parts[0].split("mmspec-part-", 1)[1].split("_", 1)[0]
    backup = s3_server.put(b, f"out/mmspec-part-{run_a}_backup.parquet", dup)
    n_dup = pq.read_table(io.BytesIO(dup)).num_rows
    resumed = run_job(spec)
    assert resumed["complete"] and resumed["duplicates"] == 0 and resumed["duplicates_dropped"] == n_dup
    assert resumed["run"]["rows"] == 0 and resumed["foreign_files"] == [backup.rsplit("/", 1)[1]]
    assert s3_keys(s3_server, b)[backup[len(f"s3://{b}/"):]] == dup
    keys = [k for k in s3_keys(s3_server, b) if k.startswith("out/mmspec-part-") and "backup" not in k]
    table = pa.concat_tables([pq.read_table(io.BytesIO(s3_keys(s3_server, b)[k])) for k in keys],
                             promote_options="permissive")
    assert_exactly_once(table, [r["id"] for r in rows])
    assert_matches_reference(table, requests, reference)
