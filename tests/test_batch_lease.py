"""One job per output, and exactly the job's own files, without Ray: the output's lease (two jobs racing, a stale
lease after a crash, the heartbeat, --break-lease), parts owned by their exact names (a user's backup of a part is
not the job's), duplicate rows of the job's own dropped on a resume, markers of earlier versions. Each case on a
local disk and on S3 (moto on loopback)."""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmspec_ray.batch.lease import LEASE_NAME, LeaseHeld, LeaseLost, acquire
from mmspec_ray.batch.output import (MARKER_NAME, claim, drop_duplicates, drop_rows, owns, read_marker, record_run,
                                     scan, seal)
from mmspec_ray.batch.storage import Location, locate
from mmspec_ray.config import S3Config

GREEDY = {"target": "/m", "drafter": "ngram", "temperature": 0.0, "max_new_tokens": 8}
RUN_A, RUN_B = "a1b2c3d4e5f6", "0f9e8d7c6b5a"
WRITE = "0123456789abcdef0123456789abcdef"


def part_name(run: str, task: int = 0) -> str:
    """A part's name exactly as the writer gives it (PartNames, then Ray Data's file index)."""
    return f"mmspec-part-{run}_{WRITE}_{task:06}-0.parquet"


def parquet(ids: list[str], kinds: list[str | None] | None = None) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ids, "error_kind": pa.array(kinds or [None] * len(ids), pa.string())}), buf)
    return buf.getvalue()


@dataclass
class Out:
    """An output directory on a local disk or S3, with raw access to its files (as a user would have)."""

    loc: Location
    s3: S3Config
    _put: object
    _get: object
    _names: object

    def put(self, name: str, data: bytes) -> None:
        self._put(name, data)

    def get(self, name: str) -> bytes:
        return self._get(name)

    def names(self) -> dict[str, bytes]:
        return {n: self.get(n) for n in self._names()}


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path) -> Out:
    if request.param == "local":
        d = tmp_path / "out"
        s3 = S3Config(region="us-east-1")

        def put(name: str, data: bytes) -> None:
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)

        return Out(locate(str(d), s3), s3, put, lambda n: (d / n).read_bytes(),
                   lambda: sorted(p.name for p in d.iterdir()) if d.exists() else [])
    server = request.getfixturevalue("s3_server")
    b = server.new_bucket("lease")

    def names() -> list[str]:
        objs = server.client.list_objects_v2(Bucket=b, Prefix="out/").get("Contents", [])
        return sorted(o["Key"][len("out/"):] for o in objs if o["Key"] != "out/")  # (pyarrow's folder marker)

    return Out(locate(f"s3://{b}/out", server.s3_config), server.s3_config,
               lambda n, data: server.client.put_object(Bucket=b, Key=f"out/{n}", Body=data),
               lambda n: server.client.get_object(Bucket=b, Key=f"out/{n}")["Body"].read(), names)


# ---------------- the lease: one job per output ----------------

def test_two_jobs_racing_for_one_output_exactly_one_gets_it(out):
    """Jobs started together: one holds the lease, every other is refused in one line naming the holder and what
    to do, having written nothing."""
    n = 6
    start = threading.Barrier(n)
    got, refused = [], []

    def job() -> None:
        start.wait()
        try:
            got.append(acquire(out.loc, out.s3))
        except LeaseHeld as e:
            refused.append(str(e))

    threads = [threading.Thread(target=job) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 1 and len(refused) == n - 1, refused
    assert all(len(r.splitlines()) == 1 and "in use by another job" in r and "--break-lease" in r for r in refused)
    assert out.names() == {LEASE_NAME: out.get(LEASE_NAME)}
    assert json.loads(out.get(LEASE_NAME))["token"] == got[0].body["token"]
    got[0].release()
    assert out.names() == {}


def test_a_stale_lease_expires_and_break_lease_takes_a_live_one(out):
    """A crashed job's lease (no heartbeat) refuses others until it expires, then the next job takes it over; the
    crashed job, were it alive, would find its lease lost. --break-lease takes a live lease at once."""
    crashed = acquire(out.loc, out.s3, heartbeat_s=3600, expiry_s=5.0)  # roomy: a loaded runner is slow
    with pytest.raises(LeaseHeld, match=r"in use by another job \(.*pid \d+.*expires"):
        acquire(out.loc, out.s3)
    time.sleep(5.2)
    nxt = acquire(out.loc, out.s3, heartbeat_s=3600)
    crashed.renew()
    assert crashed.lost and "taken over" in crashed.lost
    with pytest.raises(LeaseLost, match="lease was lost"):
        crashed.check()
    crashed.release()  # a lost lease is not the crashed job's to delete
    assert json.loads(out.get(LEASE_NAME))["token"] == nxt.body["token"]
    broke = acquire(out.loc, out.s3, break_lease=True)
    nxt.renew()
    assert nxt.lost and json.loads(out.get(LEASE_NAME))["token"] == broke.body["token"]
    broke.release()
    nxt.release()
    assert out.names() == {}


def test_the_heartbeat_keeps_a_running_jobs_lease(out):
    """The driver's heartbeat renews the expiry, so a job running longer than the expiry keeps its lease."""
    lease = acquire(out.loc, out.s3, heartbeat_s=0.2, expiry_s=5.0)  # 25 beats per expiry: safe on a loaded runner
    first = json.loads(out.get(LEASE_NAME))["expires_at"]
    time.sleep(6.0)
    with pytest.raises(LeaseHeld):
        acquire(out.loc, out.s3)
    assert json.loads(out.get(LEASE_NAME))["expires_at"] > first and not lease.lost
    lease.check()
    lease.release()
    assert out.names() == {}


def test_a_second_job_is_refused_in_one_line_exit_2_writing_nothing(out, tmp_path, capsys, ckpt):
    """Through the job CLI: while a job holds the output, another is refused (exit 2, one line, no traceback)
    before Ray starts, and the output is byte for byte as it was."""
    from mmspec_ray.batch.cli import main as job_main

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["p", "q"], "image_uri": ["x.png", "y.png"]}), src)
    first = acquire(out.loc, out.s3, heartbeat_s=3600)
    out.put("users-notes.txt", b"mine")
    before = out.names()
    s3 = ["--s3-endpoint", f"{out.s3.scheme}://{out.s3.endpoint_override}"] if out.loc.is_s3 else []
    rc = job_main(["--input", str(src), "--output", out.loc.uri, "--target", ckpt, "--drafter", "ngram", *s3],
                  "instruct")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "in use by another job" in err and "--break-lease" in err, err
    assert out.names() == before
    first.release()


# ---------------- what the job owns: exact names ----------------

def test_a_users_backup_of_a_part_is_never_read_counted_rewritten_or_deleted(out):
    """`mmspec-part-<run>_backup.parquet` carries a listed run token but is not a name the writer gives: foreign to
    a resume (not counted), to a retry (not rewritten) and to --overwrite (not deleted). Once a run ended, only the
    names and sizes the marker recorded are the job's: a copy under a writer-like name, or a part replaced by a
    user's file, is not."""
    record = record_run(out.loc, claim(out.loc, GREEDY, "in").record, RUN_A)
    out.put(part_name(RUN_A), parquet(["r1", "r2"], [None, "media.unavailable"]))
    backup = parquet(["r1", "r2", "r3"])
    out.put(f"mmspec-part-{RUN_A}_backup.parquet", backup)
    state, _ = scan(out.loc, record)
    assert sorted(state.ids.to_pylist()) == ["r1", "r2"]
    assert [f.rsplit("/", 1)[-1] for f in state.foreign] == [f"mmspec-part-{RUN_A}_backup.parquet"]
    assert drop_rows(out.loc, state, pa.array(["r2", "r3"])) == 1  # a retry rewrites the job's part only
    record = read_marker(out.loc)
    state, _ = scan(out.loc, record)
    assert state.ids.to_pylist() == ["r1"] and out.get(f"mmspec-part-{RUN_A}_backup.parquet") == backup
    record = seal(out.loc, record, state)
    assert list(record["parts"]) == [f"{part_name(RUN_A)[:-len('.parquet')]}.fix1.parquet"]
    out.put(part_name(RUN_A, 1), parquet(["r9"]))  # a user's copy, named as the (ended) run's writer would
    state, _ = scan(out.loc, record)
    assert state.ids.to_pylist() == ["r1"] and len(state.foreign) == 2
    claim(out.loc, GREEDY, "in", overwrite=True)
    assert sorted(out.names()) == sorted([MARKER_NAME, f"mmspec-part-{RUN_A}_backup.parquet", part_name(RUN_A, 1)])
    assert out.get(f"mmspec-part-{RUN_A}_backup.parquet") == backup


def test_a_part_replaced_by_a_users_file_is_not_the_jobs(out):
    record = record_run(out.loc, claim(out.loc, GREEDY, "in").record, RUN_A)
    out.put(part_name(RUN_A), parquet(["r1"]))
    state, _ = scan(out.loc, record)
    record = seal(out.loc, record, state)
    assert owns(out.loc, record, f"{out.loc.path}/{part_name(RUN_A)}", state.sizes[state.files[0]])
    mine = parquet(["u1", "u2", "u3", "u4"])
    out.put(part_name(RUN_A), mine)  # the user wrote their own file over the part
    state, _ = scan(out.loc, record)
    assert state.ids.to_pylist() == [] and len(state.foreign) == 1
    claim(out.loc, GREEDY, "in", overwrite=True)
    assert out.get(part_name(RUN_A)) == mine


# ---------------- duplicate rows of the job's own ----------------

def test_a_resume_drops_its_own_duplicate_rows_keeping_one_per_id(out):
    """Two runs (two jobs that wrote at once) answered the same rows: a resume keeps one row per id (a successful
    one over an error) and says how many it dropped; a user's file holding those ids is neither read nor touched."""
    record = record_run(out.loc, record_run(out.loc, claim(out.loc, GREEDY, "in").record, RUN_A), RUN_B)
    out.put(part_name(RUN_A), parquet(["r1", "r2", "r3"], [None, "media.unavailable", None]))
    out.put(part_name(RUN_B), parquet(["r2", "r3", "r4"]))
    out.put(part_name(RUN_B, 1), parquet(["r1"]))
    users = parquet(["r1", "r4"])
    out.put(f"mmspec-part-{RUN_B}_backup.parquet", users)
    state, _ = scan(out.loc, record)
    assert len(state.ids) == 7
    assert drop_duplicates(out.loc, state) == 3
    state, table = scan(out.loc, read_marker(out.loc), ["error_kind"])
    assert sorted(state.ids.to_pylist()) == ["r1", "r2", "r3", "r4"]
    assert table.filter(pa.compute.equal(table.column("id"), "r2")).column("error_kind").to_pylist() == [None]
    assert out.get(f"mmspec-part-{RUN_B}_backup.parquet") == users
    assert drop_duplicates(out.loc, state) == 0


# ---------------- markers of earlier versions still resume ----------------

def test_markers_of_earlier_versions_resume_with_exact_ownership(out):
    """A format-2 marker (run tokens only): its runs' parts, named as the writer names them, are the job's and a
    backup beside them is not; the run that ends records them by name. A format-1 marker (no runs): the parts
    present at the first resume are recorded by name and size."""
    out.put(MARKER_NAME, json.dumps({"format": 2, "input": "in", "settings": GREEDY, "runs": [RUN_A],
                                     "input_files": None}).encode())
    out.put(part_name(RUN_A), parquet(["r1"]))
    out.put(f"mmspec-part-{RUN_A}_backup.parquet", parquet(["r1", "r2"]))
    record = claim(out.loc, GREEDY, "in").record
    assert record["format"] == 3 and record["sealed"] == []
    state, _ = scan(out.loc, record)
    assert state.ids.to_pylist() == ["r1"] and len(state.foreign) == 1
    assert list(seal(out.loc, record_run(out.loc, record, RUN_B), state)["parts"]) == [part_name(RUN_A)]
    old = Out(out.loc.child("old"), out.s3, lambda n, d: out.put(f"old/{n}", d), lambda n: out.get(f"old/{n}"),
              None)
    old.put(MARKER_NAME, json.dumps({"format": 1, "input": "in", "settings": GREEDY}).encode())
    old.put("mmspec-part-0a1b_000000.parquet", parquet(["a"]))
    record = claim(old.loc, GREEDY, "in").record
    assert record["parts"] == {"mmspec-part-0a1b_000000.parquet": len(parquet(["a"]))}
    old.put("mmspec-part-0a1c_000000.parquet", parquet(["b"]))  # named later, by no run: not the job's
    state, _ = scan(old.loc, record_run(old.loc, record, RUN_B))
    assert state.ids.to_pylist() == ["a"] and len(state.foreign) == 1
