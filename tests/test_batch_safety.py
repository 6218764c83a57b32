"""Batch data safety without Ray: the output directory's ownership and resume rules, input checks that name the
file and column, OpenAI-style messages in rows, S3 retries through a scripted outage, bounded media memory."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmspec_ray.batch.cli import main as job_main
from mmspec_ray.batch.output import MARKER_NAME, claim, drop_rows, record_run, scan
from mmspec_ray.batch.rows import RowError, prepare_row
from mmspec_ray.batch.sources import kinetics_rows
from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.batch.storage import JobInputError, check_disjoint, locate, scan_input
from mmspec_ray.config import S3Config
from mmspec_ray.media import MediaError
from mmspec_ray.media.image import prescale_size
from mmspec_ray.media.io import read_bytes

LOCAL = S3Config(region="us-east-1")
W = "0" * 32  # a write id, as parts are named: mmspec-part-<run>_<write id>_<task>-<file>.parquet
GREEDY = {"target": "/m", "drafter": "ngram", "temperature": 0.0, "max_new_tokens": 8}


def loc(path) -> object:
    return locate(str(path), LOCAL)


def own(out, *runs: str) -> dict:
    """Claim `out` for the job and record `runs` as its runs (parts named mmspec-part-<run>_... are its own)."""
    record = claim(loc(out), GREEDY, "in").record
    for run in runs:
        record = record_run(loc(out), record, run)
    return record


def part(path, ids: list[str], kinds: list[str | None] | None = None) -> None:
    pq.write_table(pa.table({"id": ids, "error_kind": pa.array(kinds or [None] * len(ids), pa.string())}), path)


# ---------------- the output directory: what the job owns ----------------

def test_output_with_foreign_files_and_no_marker_is_refused_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    part(out / "users-data.parquet", ["a"])
    part(out / f"mmspec-part-x_{W}_000000-0.parquet", ["b"])  # looks like ours, but no marker: not provably ours
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for overwrite in (False, True):
        with pytest.raises(JobInputError, match="did not write .*marker"):
            claim(loc(out), GREEDY, "in", overwrite=overwrite)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_overwrite_deletes_only_the_jobs_own_files(tmp_path):
    out = tmp_path / "out"
    own(out, "x")
    part(out / f"mmspec-part-x_{W}_000000-0.parquet", ["a"])
    (out / "_summary.json").write_text("{}")
    part(out / "users-data.parquet", ["z"])  # dropped in later by someone: never ours to delete
    part(out / f"mmspec-part-users_{W}_000000-0.parquet", ["u"])  # named like a part, but of no run the marker lists
    (out / "sub").mkdir()
    part(out / "sub" / f"mmspec-part-y_{W}_000000-0.parquet", ["q"])  # not top level: not the job's naming
    record = claim(loc(out), GREEDY, "in", overwrite=True).record
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER_NAME, "users-data.parquet",
                                                           f"mmspec-part-users_{W}_000000-0.parquet", "sub"])
    state, _ = scan(loc(out), record)
    assert state.ids.to_pylist() == [] and [f.rsplit("/", 1)[-1] for f in sorted(state.foreign)] == [
        f"mmspec-part-users_{W}_000000-0.parquet", f"mmspec-part-y_{W}_000000-0.parquet", "users-data.parquet"]


def test_a_users_file_named_like_a_part_is_never_read_deleted_or_counted(tmp_path):
    """Only parts of the runs the marker lists are the job's: a user's `mmspec-part-*.parquet`, readable or not,
    is neither counted as done rows nor deleted as torn; a marker from before runs were listed takes the parts
    present when it is first resumed as its own, and nothing named later."""
    out = tmp_path / "out"
    record = own(out, "ab12")
    part(out / f"mmspec-part-ab12_{W}_000000-0.parquet", ["a"])
    part(out / f"mmspec-part-zz99_{W}_000000-0.parquet", ["b"])  # the user's, readable
    (out / f"mmspec-part-zz98_{W}_000000-0.parquet").write_bytes(b"PAR1 not really")  # the user's, unreadable
    state, _ = scan(loc(out), record)
    assert state.ids.to_pylist() == ["a"] and not state.removed
    assert sorted(f.rsplit("/", 1)[-1] for f in state.foreign) == [f"mmspec-part-zz98_{W}_000000-0.parquet",
                                                                    f"mmspec-part-zz99_{W}_000000-0.parquet"]
    assert (out / f"mmspec-part-zz98_{W}_000000-0.parquet").read_bytes() == b"PAR1 not really"
    old = tmp_path / "old"  # an output made when the marker listed no runs (format 1)
    old.mkdir()
    (old / MARKER_NAME).write_text(json.dumps({"format": 1, "input": "in", "settings": GREEDY}))
    part(old / "mmspec-part-0a1b_000000.parquet", ["a"])
    record = claim(loc(old), GREEDY, "in").record
    legacy = old / "mmspec-part-0a1b_000000.parquet"
    assert record["parts"] == {legacy.name: legacy.stat().st_size}  # recorded by exact name and size
    record = record_run(loc(old), record, "run1")
    part(old / "mmspec-part-0a1c_000000.parquet", ["b"])  # named later, by no run: not the job's
    state, _ = scan(loc(old), json.loads((old / MARKER_NAME).read_text()))
    assert state.ids.to_pylist() == ["a"] and len(state.foreign) == 1


def test_resume_with_other_settings_is_refused_naming_the_difference(tmp_path):
    out = loc(tmp_path / "out")
    claim(out, GREEDY, "in")
    claim(out, GREEDY | {"drafter": "eagle2", "seed": 5}, "in")  # greedy: a drafter cannot change the text
    with pytest.raises(JobInputError, match=r"max_new_tokens: 8 -> 16"):
        claim(out, GREEDY | {"max_new_tokens": 16}, "in")
    with pytest.raises(JobInputError, match=r"temperature: 0.0 -> 0.7"):
        claim(out, GREEDY | {"temperature": 0.7}, "in")
    for overwrite in (False, True):  # another dataset's ids would pass as done; its answers are not ours to delete
        with pytest.raises(JobInputError, match=r"another job \(input '/.*/in'\)"):
            claim(out, GREEDY, "other", overwrite=overwrite)
    sampled = tmp_path / "sampled"
    claim(loc(sampled), GREEDY | {"temperature": 0.7}, "in")
    with pytest.raises(JobInputError, match=r"drafter: 'ngram' -> 'eagle2'"):  # sampling: the drafter shows
        claim(loc(sampled), GREEDY | {"temperature": 0.7, "drafter": "eagle2"}, "in")
    half = tmp_path / "half"  # bfloat16: a drafter (or the tie margin) can change greedy text, so it shows too
    claim(loc(half), GREEDY | {"dtype": "bfloat16"}, "in")
    with pytest.raises(JobInputError, match=r"drafter: 'ngram' -> 'eagle2'"):
        claim(loc(half), GREEDY | {"dtype": "bfloat16", "drafter": "eagle2"}, "in")


def test_decode_config_records_every_text_setting():
    cfg = DecodeConfig(target="/m", temperature=0.5, max_new_tokens=9, media={"num_frames": 4})
    s = cfg.text_settings()
    assert {"target", "drafter", "dtype", "tie_margin", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "seed", "max_new_tokens", "stop", "default_prompt", "media", "tree"} == set(s)
    assert s["media"]["num_frames"] == 4 and "device" not in s and "s3" not in s
    assert "limits" not in s["media"] and "short_side" not in s["media"]  # they refuse rows, never change text


def test_a_resume_may_change_only_the_refusal_bounds(tmp_path):
    """An output whose marker recorded media size limits (as markers once did) resumes under other limits and
    a new short side: they decide which rows are refused, not an answer's text. Frames per clip still count."""
    old = DecodeConfig(target="/m", media={"num_frames": 4}).text_settings()
    old["media"] |= {"limits": {"max_bytes": 1, "max_image_pixels": 2}, "short_side": 336}
    claim(loc(tmp_path / "o"), old, "in")
    new = DecodeConfig(target="/m", media={"num_frames": 4, "limits": {"max_aspect_ratio": 9}}).text_settings()
    claim(loc(tmp_path / "o"), new, "in")
    with pytest.raises(JobInputError, match="num_frames"):
        claim(loc(tmp_path / "o"), DecodeConfig(target="/m", media={"num_frames": 8}).text_settings(), "in")


def test_drop_rows_rewrites_parts_and_a_crash_between_leaves_the_newer(tmp_path):
    out = tmp_path / "out"
    record = own(out, "a", "b", "c")
    part(out / f"mmspec-part-a_{W}_000000-0.parquet", ["r1", "r2", "r3"], [None, "media.unavailable", None])
    part(out / f"mmspec-part-b_{W}_000000-0.parquet", ["r4"], ["media.unavailable"])
    part(out / f"mmspec-part-c_{W}_000000-0.parquet", ["r5"])
    untouched = (out / f"mmspec-part-c_{W}_000000-0.parquet").read_bytes()
    state, _ = scan(loc(out), record)
    assert drop_rows(loc(out), state, pa.array(["r2", "r4"])) == 2
    names = sorted(p.name for p in out.glob("mmspec-part-*"))
    assert names == [f"mmspec-part-a_{W}_000000-0.fix1.parquet", f"mmspec-part-c_{W}_000000-0.parquet"]
    assert (out / f"mmspec-part-c_{W}_000000-0.parquet").read_bytes() == untouched
    state, _ = scan(loc(out), record)
    assert sorted(state.ids.to_pylist()) == ["r1", "r3", "r5"]
    # a crash after writing generation 2 but before deleting generation 1: the scan keeps generation 2 only
    part(out / f"mmspec-part-a_{W}_000000-0.fix2.parquet", ["r1"])
    state, _ = scan(loc(out), record)
    assert sorted(state.ids.to_pylist()) == ["r1", "r5"]
    assert not (out / f"mmspec-part-a_{W}_000000-0.fix1.parquet").exists()
    # a crash in the middle of writing generation 3 (torn): generation 2 stays live, its rows are not lost
    (out / f"mmspec-part-a_{W}_000000-0.fix3.parquet").write_bytes((out / f"mmspec-part-a_{W}_000000-0.fix2.parquet")
                                                            .read_bytes()[:-12])
    state, _ = scan(loc(out), record)
    assert sorted(state.ids.to_pylist()) == ["r1", "r5"] and (out / f"mmspec-part-a_{W}_000000-0.fix2.parquet").exists()
    assert [p.rsplit("/", 1)[-1] for p in state.removed] == [f"mmspec-part-a_{W}_000000-0.fix3.parquet"]


def test_overlap_through_a_symlink_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with pytest.raises(JobInputError, match="overlap"):
        check_disjoint(loc(tmp_path / "data"), loc(tmp_path / "link" / "out"))


@pytest.mark.parametrize("a,b,overlap", [
    ("s3://b/data", "s3://b/data", True), ("s3://b/data/", "s3://b/data/out", True),
    ("s3://b/data/in", "s3://b/data", True), ("s3://b/data", "s3://b/data2", False),
    ("s3://b/in", "s3://c/in", False), ("/x/in", "/x/in/out", True), ("/x/in", "/x/out", False),
])
def test_overlapping_input_and_output_are_refused(a, b, overlap):
    if overlap:
        with pytest.raises(JobInputError, match="overlap"):
            check_disjoint(loc(a), loc(b))
        with pytest.raises(JobInputError, match="overlap"):
            check_disjoint(loc(b), loc(a))
    else:
        check_disjoint(loc(a), loc(b))


def test_a_failing_read_never_deletes_a_part_and_old_parts_lack_columns_harmlessly(tmp_path, monkeypatch):
    import mmspec_ray.batch.output as output

    out = tmp_path / "out"
    record = own(out, "old")
    pq.write_table(pa.table({"id": ["a"]}), out / f"mmspec-part-old_{W}_000000-0.parquet")  # written before error_kind
    state, table = scan(loc(out), record, ["error_kind"])
    assert table.column("error_kind").to_pylist() == [None] and not state.removed

    def throttled(*a, **k):
        raise OSError("AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate.")

    monkeypatch.setattr(output.pq, "ParquetFile", throttled)
    monkeypatch.setattr(output.time, "sleep", lambda s: None)
    with pytest.raises(JobInputError, match="nothing was deleted"):
        scan(loc(out), record, ["error_kind"])
    assert (out / f"mmspec-part-old_{W}_000000-0.parquet").exists()


def test_transient_s3_errors_are_told_from_final_ones():
    from mmspec_ray.media.io import is_transient

    for text in ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Couldn't connect to server",
                 "AWS Error SLOW_DOWN during GetObject", "AWS Error UNKNOWN (HTTP status 503) during GetObject",
                 "AWS Error UNKNOWN (HTTP status 429) during GetObject", "AWS Error INTERNAL_FAILURE"):
        assert is_transient(OSError(text)), text
    for text in ("AWS Error ACCESS_DENIED during GetObject operation: Access Denied (HTTP status 403)",
                 "AWS Error NO_SUCH_KEY", "AWS Error UNKNOWN (HTTP status 400) during GetObject"):
        assert not is_transient(OSError(text)), text


def test_retry_errors_takes_known_kinds_only():
    from pydantic import ValidationError

    from mmspec_ray.batch.jobspec import JobSpec

    spec = JobSpec(input="i", output="o", decode={"target": "/m"}, retry_errors=("crash", "media.not_found"))
    assert spec.retry_errors == ("crash", "media.not_found")
    with pytest.raises(ValidationError, match="unknown error kind"):
        JobSpec(input="i", output="o", decode={"target": "/m"}, retry_errors=("media.notfound",))


# ---------------- malformed inputs: one line naming the file and the column ----------------

def test_malformed_input_files_are_named(tmp_path):
    d = tmp_path / "types"
    d.mkdir()
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"]}), d / "0.parquet")
    pq.write_table(pa.table({"id": ["b"], "prompt": [3]}), d / "1.parquet")
    with pytest.raises(JobInputError, match=r"1\.parquet: column 'prompt' is int64 but string"):
        scan_input(loc(d))
    (d / "1.parquet").write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(JobInputError, match=r"input file .*1\.parquet is not readable parquet"):
        scan_input(loc(d))
    s = tmp_path / "struct.parquet"
    pq.write_table(pa.table({"id": [{"k": 1}], "prompt": ["p"]}), s)
    with pytest.raises(JobInputError, match=r"struct\.parquet: column 'id' is struct"):
        scan_input(loc(s))
    csv = tmp_path / "ann.csv"
    csv.write_text("label,youtube_id,time_start,time_end,split\nx,abc,notanumber,10,val\n")
    with pytest.raises(JobInputError, match=r"ann\.csv: column 'time_start', row 1 .*'notanumber'"):
        kinetics_rows(str(csv), str(tmp_path), "p", LOCAL)
    csv.write_text("label,youtube_id,time_start,time_end,split\nx,abc,5,,val\n")  # was a null, then a TypeError
    with pytest.raises(JobInputError, match=r"ann\.csv: column 'time_end', row 1 .*''"):
        kinetics_rows(str(csv), str(tmp_path), "p", LOCAL)


def _malformed(tmp_path) -> dict:
    """name -> (job, flags, what the one error line must name), each input wrong in one way."""

    def write(rows: list[dict], name: str, **cols) -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({**{k: [r[k] for r in rows] for k in rows[0]}, **cols}), path)
        return str(path)

    ok = [{"id": "a", "prompt": "p", "image_uri": "x.png"}]
    write(ok, "types/0.parquet")
    write([{"id": "b", "prompt": 3, "image_uri": "y.png"}], "types/1.parquet")
    write(ok, "garbage/0.parquet")
    (tmp_path / "garbage" / "1.parquet").write_bytes(b"PAR1 not parquet at all PAR1")
    write(ok, "dups/0.parquet")
    write([{"id": "c", "prompt": "q", "image_uri": "z.png"}, {"id": "a", "prompt": "r", "image_uri": "w.png"}],
          "dups/1.parquet")
    csv = tmp_path / "ann.csv"
    csv.write_text("label,youtube_id,time_start,time_end,split\nx,abc,notanumber,10,val\n")
    neg = tmp_path / "neg.csv"
    neg.write_text("label,youtube_id,time_start,time_end,split\nx,abc,0,10,val\ny,def,-5,10,val\n")
    return {
        "types disagree": ("instruct", ["--input", str(tmp_path / "types")], ["types/1.parquet", "'prompt'"]),
        "garbage parquet": ("instruct", ["--input", str(tmp_path / "garbage")], ["garbage/1.parquet"]),
        "struct id": ("instruct", ["--input", write([{"prompt": "p", "image_uri": "x"}], "struct.parquet",
                                                    id=[{"k": 1}])], ["struct.parquet", "'id'"]),
        "no id": ("instruct", ["--input", write([{"prompt": "p", "image_uri": "x"}], "noid.parquet")],
                  ["noid.parquet", "`id`"]),
        "duplicate ids": ("instruct", ["--input", str(tmp_path / "dups")],
                          ["dups", "'id'", "duplicated", "dups/0.parquet", "dups/1.parquet"]),
        "no media column": ("instruct", ["--input", write([{"id": "a", "prompt": "p"}], "nomedia.parquet")],
                            ["nomedia.parquet", "image / image_uri"]),
        "bad csv value": ("caption_kinetics", ["--input", str(csv), "--clip-root", str(tmp_path)],
                          ["ann.csv", "'time_start'", "notanumber"]),
        "negative time": ("caption_kinetics", ["--input", str(neg), "--clip-root", str(tmp_path)],
                          ["neg.csv", "row 2", "time_start -5", "0 <= time_start <= time_end"]),
        "no clip root": ("caption_kinetics", ["--input", str(csv)], ["error: ", "needs --clip-root"]),
    }


@pytest.mark.parametrize("case", ["types disagree", "garbage parquet", "struct id", "no id", "duplicate ids",
                                  "no media column", "bad csv value", "negative time", "no clip root"])
def test_each_malformed_input_fails_up_front_in_one_line(tmp_path, capsys, ckpt, case):
    """Through the job CLI: exit code 2, one line naming the file and the column, no traceback, nothing written."""
    job, flags, named = _malformed(tmp_path)[case]
    out = tmp_path / "out"
    rc = job_main(flags + ["--output", str(out), "--target", ckpt], job)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(n in err for n in named), err
    assert not out.exists()


def test_job_cli_prints_one_line_and_exits_2(tmp_path, capsys, ckpt):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "a"], "prompt": ["p", "q"], "image_uri": ["x.png", "y.png"]}), src)
    rc = job_main(["--input", str(src), "--output", str(tmp_path / "out"), "--target", ckpt], "instruct")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "duplicated ids" in err and "Traceback" not in err
    rc = job_main(["--input", str(src), "--output", str(tmp_path / "o2"), "--target", ckpt,
                   "--max-new-tokens", "0"], "instruct")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "max_new_tokens" in err


# ---------------- OpenAI-style messages in rows ----------------

def png_bytes(size=(16, 12)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def test_messages_with_string_content_and_an_image_column_work():
    cfg = DecodeConfig(target="/m", media={"image_side": None})
    row = {"id": "r", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "what is this?"}], "image": png_bytes()}
    req = prepare_row(row, cfg)
    assert req.messages == [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}]
    assert len(req.images) == 1


@pytest.mark.parametrize("messages,field", [
    ([{"foo": 1}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "t"}]}], "messages"),
    (["hello"], "messages[0]"),
])
def test_bad_messages_are_invalid_naming_the_field(messages, field):
    with pytest.raises(RowError) as e:
        prepare_row({"id": "r", "messages": messages, "image": png_bytes()}, DecodeConfig(target="/m"))
    assert e.value.kind == "invalid" and e.value.field == field, str(e.value)


# ---------------- S3 outages: transient errors retried with backoff ----------------

class FlakyProxy:
    """A TCP forwarder on loopback in front of the moto server. `cut()` starts an outage: open connections are
    broken and new ones dropped until `restore()` (or `down = False`)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.down = False
        self.dropped = 0  # connections refused while down
        self.first_use: float | None = None  # monotonic time of the first connection forwarded
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def cut(self) -> None:
        self.down = True
        with self._lock:
            for s in list(self._open):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def restore(self) -> None:
        self.down = False

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            if self.down:
                self.dropped += 1
                conn.close()
                continue
            if self.first_use is None:
                self.first_use = time.monotonic()
            up = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._open |= {conn, up}
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._open -= {a, b}

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def flaky(s3_server):
    proxy = FlakyProxy(s3_server.port)
    yield proxy
    proxy.close()


def proxied(proxy: FlakyProxy, **retry) -> S3Config:
    return S3Config(endpoint_override=f"127.0.0.1:{proxy.port}", scheme="http", region="us-east-1", **retry)


def test_s3_read_survives_a_short_outage_and_marks_a_long_one_retryable(s3_server, flaky):
    b = s3_server.new_bucket("flaky")
    uri = s3_server.put(b, "x.bin", b"payload")
    cfg = proxied(flaky, retries=4, retry_base_s=0.3, retry_max_s=1.0)  # waits 0.3 + 0.6 + 1 + 1 s
    assert read_bytes(uri, s3=cfg) == b"payload"
    flaky.cut()  # the connection the first read left open breaks too
    threading.Timer(1.0, flaky.restore).start()
    t0 = time.monotonic()
    assert read_bytes(uri, s3=cfg) == b"payload", "a 1 s outage is bridged by the retries"
    assert time.monotonic() - t0 >= 0.9
    flaky.down = True
    with pytest.raises(MediaError) as e:
        read_bytes(uri, s3=proxied(flaky, retries=1, retry_base_s=0.1))
    assert e.value.kind == "unavailable" and "re-run" in str(e.value)
    flaky.down = False
    with pytest.raises(MediaError) as e:  # a missing object is final at once, never retried
        read_bytes(f"s3://{b}/nope.bin", s3=proxied(flaky, retries=5, retry_base_s=5.0))
    assert e.value.kind == "not_found"


# ---------------- memory: huge images and frame-count-less clips ----------------

def test_prescale_keeps_what_the_processor_needs():
    assert prescale_size(7990, 7990, 336) == (336, 336)
    assert prescale_size(4000, 3000, 336) == (448, 336)
    assert prescale_size(7990, 7990, 3584) == (3584, 3584)  # Qwen2.5-VL: max 12.8 M pixels = 3,584 px a side
    assert prescale_size(640, 480, 336) == (448, 336)
    assert prescale_size(300, 480, 336) is None  # the short edge is not above what the processor uses: untouched
    assert prescale_size(336, 40000, 336) is None
    assert prescale_size(7990, 7990, None) is None


def test_processor_side_from_saved_configs(tmp_path):
    from mmspec_ray.batch.rows import resolve_image_side
    from mmspec_ray.targets.media_size import max_side_of

    clip = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
    qwen = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14}  # min / max pixels
    anyres = {"size": {"shortest_edge": 384}, "image_grid_pinpoints": [[384, 768], [768, 384], [2304, 2304]]}
    idefics = {"size": {"longest_edge": 1456}, "max_image_size": {"longest_edge": 364}}
    assert [max_side_of([c]) for c in (clip, qwen, anyres, idefics)] == [336, 3584, 2304, 1456]
    qwen3 = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16}  # both pixel counts
    assert max_side_of([qwen3]) == 4096
    assert max_side_of([{"image_processor": clip}]) == 336 and max_side_of([{"foo": 1}]) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(clip))
    cfg = resolve_image_side(DecodeConfig(target=str(tmp_path)))
    assert cfg.media.image_side == 336
    assert resolve_image_side(DecodeConfig(target=str(tmp_path), media={"image_side": None})).media.image_side is None
    (tmp_path / "processor_config.json").mkdir()  # unreadable: an error, never scaling silently turned off
    with pytest.raises(JobInputError, match="processor_config.json"):
        resolve_image_side(DecodeConfig(target=str(tmp_path)))


def test_huge_video_frames_are_refused_before_decoding():
    from mmspec_ray.config import MediaLimits
    from mmspec_ray.media import load_video
    from mmspec_ray.toy.clips import encode_mp4
    from tiny import random_images

    clip = encode_mp4(random_images(4, seed=5), fps=4)
    w, h = load_video(clip, num_frames=1).frames[0].size
    with pytest.raises(MediaError, match=f"{w}x{h} frames > limit") as e:
        load_video(clip, num_frames=2, limits=MediaLimits(max_image_pixels=w * h - 1))
    assert e.value.kind == "too_large"


PROBE = r"""
import io, json, pickle, resource, sys
from mmspec_ray.batch.rows import prepare_row
from mmspec_ray.batch.jobspec import DecodeConfig
kind, path, side = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = DecodeConfig(target="/m", media={"image_side": side, "num_frames": 8})
req = prepare_row({"id": "r", "prompt": "p", kind: open(path, "rb").read()}, cfg)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mb": (peak - base) / 1024, "request_mb": len(pickle.dumps(req)) / 2**20}))
"""


def probe(kind: str, path, side) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, kind, str(path), json.dumps(side)], capture_output=True,
                       text=True, timeout=300, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_huge_png_reaches_the_decoder_small(tmp_path):
    path = tmp_path / "huge.png"
    Image.new("RGB", (7990, 7990), (30, 120, 200)).save(path, "PNG")
    got = probe("image", path, 336)
    assert got["request_mb"] < 2.0, got  # 336 x 336 RGB: 0.3 MB (the full image would be 183 MB)
    assert got["growth_mb"] < 700, got


def test_frame_count_less_clip_keeps_only_the_sampled_frames(tmp_path):
    import av
    import numpy as np

    path = tmp_path / "long.mkv"
    with av.open(str(path), "w", format="matroska") as c:
        s = c.add_stream("mpeg4", rate=30)
        s.width, s.height, s.pix_fmt = 640, 480, "yuv420p"
        for i in range(600):
            frame = np.full((480, 640, 3), i % 256, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    with av.open(str(path)) as c:
        assert not c.streams.video[0].frames, "the container must not declare its frame count"
    got = probe("video", path, None)
    assert got["growth_mb"] < 150, got  # all 600 frames kept would be ~270 MB of YUV
    assert got["request_mb"] < 8.0, got  # 8 RGB frames of 640 x 480: 7.0 MB


def test_video_pixel_budget_refuses_an_fps_sampling_past_it(tmp_path):
    from mmspec_ray.config import MediaLimits
    from mmspec_ray.media import load_video
    from mmspec_ray.toy.clips import encode_mp4
    from tiny import random_images

    clip = encode_mp4(random_images(12, seed=3), fps=12)
    w, h = load_video(clip, num_frames=1).frames[0].size
    assert len(load_video(clip, fps=12, limits=MediaLimits(max_video_pixels=12 * w * h)).frames) == 12
    with pytest.raises(MediaError) as e:
        load_video(clip, fps=12, limits=MediaLimits(max_video_pixels=5 * w * h))
    assert e.value.kind == "too_large" and "--fps" in str(e.value)


def test_redecode_changed_takes_out_the_changed_files_rows_only_whatever_the_limit(tmp_path):
    """The rows of a changed input file are taken out to be decoded again, rows gone from the input are dropped,
    and rows of unchanged files stay, also those past a --limit (the pipeline's own step, without Ray)."""
    import time as _time

    from mmspec_ray.batch.pipeline import _drop_changed
    from mmspec_ray.batch.storage import input_fingerprints, parquet_files

    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(pa.table({"id": ["a1", "a2"]}), src / "a.parquet")
    pq.write_table(pa.table({"id": ["b1", "b2", "b3"]}), src / "b.parquet")
    out = tmp_path / "out"
    files = parquet_files(loc(src))
    record = claim(loc(out), GREEDY, "in", input_fingerprints(loc(src), files)).record
    record = record_run(loc(out), record, "r1")
    part(out / f"mmspec-part-r1_{W}_000000-0.parquet", ["a1", "a2", "b1", "b2", "b3"])
    _time.sleep(0.01)
    pq.write_table(pa.table({"id": ["b1", "b2"]}), src / "b.parquet")  # b3 leaves the input, b1 b2 change
    prints = input_fingerprints(loc(src), files)
    with pytest.raises(JobInputError, match=r"the input changed since output .*b\.parquet: .*--redecode-changed"):
        claim(loc(out), GREEDY, "in", prints)
    claimed = claim(loc(out), GREEDY, "in", prints, redecode_changed=True)
    assert claimed.changed_files == ["b.parquet"]
    state, _ = scan(loc(out), claimed.record)
    per_file = pa.chunked_array([pq.read_table(f).column("id").combine_chunks() for f in files])
    assert _drop_changed(loc(out), state, claimed, per_file, files, loc(src)) == 3
    state, _ = scan(loc(out), claimed.record)
    assert sorted(state.ids.to_pylist()) == ["a1", "a2"]  # a2 kept though a --limit 1 run would not decode it


def _job_input(tmp_path: Path, table: pa.Table) -> Path:
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    return src


@pytest.mark.parametrize("case", ["duplicate columns", "GPUs on a machine without", "an output that is a file"])
def test_job_level_mistakes_are_one_line_before_ray_starts(ckpt, tmp_path, capsys, monkeypatch, case):
    """Refused in one line with exit 2, before Ray starts and before anything is written, the run and its dry run
    alike: duplicate column names (Ray's table would fail on them mid-job), GPUs per actor on a machine with none, an
    output path that is an existing file (a drafter made for another checkpoint: test_drafter_refusals.py)."""
    import ray

    from mmspec_ray.batch.cli import main as job_main

    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args, named = [], ""
    if case == "duplicate columns":
        table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["p"]), pa.array(["q"]), pa.array(["x.png"])],
                                     names=["id", "prompt", "prompt", "image_uri"])
        named = "duplicate column name(s) ['prompt']"
    else:
        table = pa.table({"id": ["a"], "prompt": ["p"], "image_uri": ["x.png"]})
    if case == "GPUs on a machine without":
        args, named = ["--gpus-per-actor", "1"], "--gpus-per-actor 1 but this machine has no GPU"
        import torch

        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    out = tmp_path / "out"
    if case == "an output that is a file":
        out.write_text("the user's notes")
        named = "is a file"
    src = _job_input(tmp_path, table)
    for dry in (["--dry-run"], []):
        rc = job_main(["--input", str(src), "--output", str(out), "--target", ckpt, "--drafter", "ngram", *args,
                       *dry], "instruct")
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and named in err, err
        assert (out.read_text() == "the user's notes" if out.is_file() else not out.exists())
        assert not ray.is_initialized()


# ---------------- what an input is: its files, whatever their names, and whatever the URI's spelling ----------------

def _write_ids(path, ids: list[str]) -> None:
    pq.write_table(pa.table({"id": ids, "prompt": [f"p {i}" for i in ids]}), path)


def test_every_parquet_file_of_an_input_folder_is_read_and_other_files_refused(tmp_path):
    """An input folder's files named *.parquet, *.parq or *.pq in any case are read (`_` / `.` names skipped); any
    other file refuses the folder, naming it (never skipped silently). A single file is read whatever its name, if
    it has a suffix (Ray Data's reader picks files by suffix: it is given those of the listed files)."""
    from mmspec_ray.batch.storage import file_suffixes, parquet_files

    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    _write_ids(src / "a.parquet", ["a1", "a2", "a3", "a4"])
    _write_ids(src / "b.PARQUET", ["b1", "b2", "b3", "b4"])
    _write_ids(src / "c.parq", ["c1", "c2"])
    _write_ids(src / "sub" / "d.Pq", ["c3", "c4"])
    (src / "_SUCCESS").write_text("")
    (src / ".a.parquet.crc").write_text("crc")
    files = parquet_files(loc(src))
    assert sorted(p.rsplit("/", 1)[-1] for p in files) == ["a.parquet", "b.PARQUET", "c.parq", "d.Pq"]
    assert file_suffixes(files) == ["parq", "parquet", "pq"]
    _, ids = scan_input(loc(src))
    assert len(ids) == 12
    _write_ids(src / "sub" / "part-00000", ["e1"])  # parquet, but named so that it would not be read
    (src / "notes.txt").write_text("not parquet")
    with pytest.raises(JobInputError, match=r"2 file\(s\) not named \*\.parquet, \*\.parq or \*\.pq \(e\.g\. "
                                            r".*/in/notes\.txt, .*/in/sub/part-00000\)"):
        scan_input(loc(src))
    single = tmp_path / "rows.bin"
    _write_ids(single, ["s1"])
    assert len(scan_input(loc(single))[1]) == 1 and file_suffixes([str(single)]) == ["bin"]
    with pytest.raises(JobInputError, match="input file part-00000 has no file suffix; name it \\*\\.parquet"):
        scan_input(loc(src / "sub" / "part-00000"))


def test_an_input_spelled_another_way_is_the_same_input(tmp_path, monkeypatch):
    """A trailing slash, ./, a relative path, file://: one input. A copy elsewhere (new mtimes, same bytes) is the
    same input too; a copy with a changed file is refused, and with --redecode-changed its changed file is redone."""
    import shutil

    from mmspec_ray.batch.storage import canonical_uri, input_fingerprints

    monkeypatch.chdir(tmp_path)
    src = tmp_path / "in"
    src.mkdir()
    _write_ids(src / "a.parquet", ["a1"])
    _write_ids(src / "b.parquet", ["b1"])
    out = loc(tmp_path / "out")
    prints = input_fingerprints(loc(src))
    claim(out, GREEDY, str(src), prints)
    for spelling in (f"{src}/", "in", "./in/", f"file://{src}", f"file://{src}/", "../" + tmp_path.name + "/in"):
        assert canonical_uri(spelling) == str(src)
        assert claim(out, GREEDY, spelling, input_fingerprints(loc(spelling))).changed == [], spelling
        assert claim(out, GREEDY, spelling, input_fingerprints(loc(spelling)), redecode_changed=True).changed == []
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)  # new mtimes, the same bytes
    os_utime_later(copy / "a.parquet")
    assert claim(out, GREEDY, str(copy), input_fingerprints(loc(copy))).changed == []
    _write_ids(copy / "b.parquet", ["b1", "b2"])
    with pytest.raises(JobInputError, match=r"another job \(input '.*/in'\); this job reads '.*/copy', whose files "
                                            r"differ.*--redecode-changed"):
        claim(out, GREEDY, str(copy), input_fingerprints(loc(copy)))
    claimed = claim(out, GREEDY, str(copy), input_fingerprints(loc(copy)), redecode_changed=True)
    assert claimed.changed_files == ["b.parquet"]
    other = tmp_path / "other"
    other.mkdir()
    _write_ids(other / "x.parquet", ["x1"])
    for redecode in (False, True):  # no file in common: another dataset, whatever the flag
        with pytest.raises(JobInputError, match="another job"):
            claim(out, GREEDY, str(other), input_fingerprints(loc(other)), redecode_changed=redecode)
    namesake = tmp_path / "namesake"  # another dataset whose files share the names, every one with other rows
    namesake.mkdir()
    _write_ids(namesake / "a.parquet", ["n1"])
    _write_ids(namesake / "b.parquet", ["n2"])
    for redecode in (False, True):  # a shared name is not a copy: its answers are not dropped as gone
        with pytest.raises(JobInputError, match="another job"):
            claim(out, GREEDY, str(namesake), input_fingerprints(loc(namesake)), redecode_changed=redecode)


def os_utime_later(path, seconds: float = 100.0) -> None:
    import os

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + int(seconds * 1e9)))


def test_a_file_replaced_with_the_same_size_and_mtime_is_a_change(tmp_path):
    """Local disk: the md5 of the file's bytes tells it; a marker without hashes (an earlier version's) still
    resumes, compared on what it has."""
    import os

    from mmspec_ray.batch.storage import fingerprint_changes, input_fingerprints

    src = tmp_path / "in"
    src.mkdir()
    _write_ids(src / "a.parquet", ["a1", "a2"])
    _write_ids(src / "b.parquet", ["b1", "b2"])
    out = loc(tmp_path / "out")
    old = input_fingerprints(loc(src))
    claim(out, GREEDY, str(src), old)
    st = (src / "b.parquet").stat()
    _write_ids(src / "b.parquet", ["b1", "b9"])  # other bytes, same size
    os.utime(src / "b.parquet", ns=(st.st_atime_ns, st.st_mtime_ns))
    new = input_fingerprints(loc(src))
    assert (new["b.parquet"]["size"], new["b.parquet"]["mtime"]) == (old["b.parquet"]["size"],
                                                                     old["b.parquet"]["mtime"])
    assert [c.split(":")[0] for c in fingerprint_changes(old, new)] == ["b.parquet"]
    assert "md5" in fingerprint_changes(old, new)[0]
    with pytest.raises(JobInputError, match=r"the input changed since .*b\.parquet: md5"):
        claim(out, GREEDY, str(src), new)
    assert claim(out, GREEDY, str(src), new, redecode_changed=True).changed_files == ["b.parquet"]
    legacy = {n: {k: v for k, v in f.items() if k in ("size", "mtime")} for n, f in new.items()}
    assert fingerprint_changes(legacy, new) == []  # an earlier marker: size and mtime only
    no_mtime = {"a.parquet": {"size": new["a.parquet"]["size"], "sha256": "x"}}  # a store without mtimes
    assert fingerprint_changes(no_mtime, new) == ["b.parquet: new"]  # a.parquet: only the size is in both


def test_s3_input_spellings_its_local_copy_and_a_same_size_replacement(s3_server, tmp_path):
    """On S3 the ETag identifies a file: an s3:// input spelled with a trailing or doubled slash, and its local copy,
    are the same input; an object replaced with the same size (and, within the same second, the same mtime) is a
    change."""
    from mmspec_ray.batch.storage import fingerprint_changes, input_fingerprints

    s3 = s3_server.s3_config
    bucket = s3_server.new_bucket("prints")
    local = tmp_path / "copy"
    local.mkdir()
    for name, ids in (("a.parquet", ["a1"]), ("sub/b.parquet", ["b1", "b2"])):
        path = local / name
        path.parent.mkdir(exist_ok=True)
        _write_ids(path, ids)
        s3_server.put(bucket, f"in/{name}", path.read_bytes())
    uri = f"s3://{bucket}/in"
    prints = input_fingerprints(locate(uri, s3))
    assert set(prints) == {"a.parquet", "sub/b.parquet"} and all("etag" in p and "md5" in p for p in prints.values())
    out = loc(tmp_path / "out")
    claim(out, GREEDY, uri, prints)
    for spelling in (f"{uri}/", f"s3://{bucket}//in/"):
        assert claim(out, GREEDY, spelling, input_fingerprints(locate(spelling, s3))).changed == []
    assert claim(out, GREEDY, str(local), input_fingerprints(loc(local))).changed == []  # its local copy
    _write_ids(local / "a.parquet", ["a9"])  # same size, other bytes
    s3_server.put(bucket, "in/a.parquet", (local / "a.parquet").read_bytes())
    new = input_fingerprints(locate(uri, s3))
    new["a.parquet"]["mtime"] = prints["a.parquet"]["mtime"]  # as within the same second (S3 mtimes are seconds)
    assert new["a.parquet"]["size"] == prints["a.parquet"]["size"]
    assert [c.split(":")[0] for c in fingerprint_changes(prints, new)] == ["a.parquet"]
    with pytest.raises(JobInputError, match=r"the input changed since .*\(a\.parquet: md5 \w+ -> \w+\)"):
        claim(out, GREEDY, uri, new)


def test_media_fingerprints_name_the_rows_whose_media_changed(tmp_path):
    """A row is stale when one of its URIs changed or disappeared, or when no fingerprint was recorded for it;
    rows not yet decoded are not this check's business."""
    from mmspec_ray.batch.media_prints import changed_ids, media_prints
    from mmspec_ray.config import S3Config

    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.png").write_bytes(name.encode())
    rows = pa.table({"id": ["r1", "r2", "r3", "r4"],
                     "image_uri": [str(tmp_path / "a.png"), str(tmp_path / "b.png"), None, str(tmp_path / "c.png")]})
    s3 = S3Config()
    old = media_prints(rows, s3)
    assert old.column("id").to_pylist() == ["r1", "r2", "r4"]  # r3 names no media by URI
    done = pa.array(["r1", "r2", "r3", "r4"])
    assert changed_ids(old, media_prints(rows, s3), done).to_pylist() == []
    (tmp_path / "b.png").write_bytes(b"bb")  # another size
    (tmp_path / "c.png").unlink()
    assert sorted(changed_ids(old, media_prints(rows, s3), done).to_pylist()) == ["r2", "r4"]
    assert changed_ids(old, media_prints(rows, s3), pa.array(["r1"])).to_pylist() == []
    assert sorted(changed_ids(None, old, done).to_pylist()) == ["r1", "r2", "r4"]  # none recorded: all stale


def test_media_fingerprints_of_rows_past_a_limit_are_kept():
    """A run with --limit records the rows it covers and keeps the others' recorded fingerprints."""
    from mmspec_ray.batch.media_prints import merge_prints

    old = pa.table({"id": ["a", "b", "c"], "fingerprint": ["1", "2", "3"]})
    new = pa.table({"id": ["a"], "fingerprint": ["9"]})
    got = dict(zip(*merge_prints(old, new).to_pydict().values()))
    assert got == {"a": "9", "b": "2", "c": "3"}
