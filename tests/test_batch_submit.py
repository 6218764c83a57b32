"""`ray job submit --working-dir . -- python jobs/instruct.py ...` against a local `ray start --head` (through
jobs/local_cluster.sh, which starts the head in its own temp dir and stops only that head).

Other Ray instances may run on the same host (tests beside this one): the head gets free ports of its own, its
dashboard agent's included (the script's default), and a run past the time limit is stopped through the script's
own exit trap, so that no head is left behind holding ports."""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from tiny import random_images, tiny_llava

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("bash") is None or not (ROOT / ".venv/bin/ray").exists(),
                    reason="needs bash and the project venv's ray CLI")
def test_ray_job_submit_on_local_head(tmp_path):
    ckpt = tmp_path / "ckpt"
    model, processor = tiny_llava()
    model.save_pretrained(ckpt)
    processor.save_pretrained(ckpt)
    rows = []
    for i, img in enumerate(random_images(3, seed=30)):
        buf = io.BytesIO()
        img.save(buf, "PNG")
        rows.append({"id": f"r{i}", "prompt": "describe the image", "image": buf.getvalue()})
    rows.append({"id": "bad", "prompt": "describe", "image": b"not an image"})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    out = tmp_path / "out"
    cmd = ["bash", "jobs/local_cluster.sh", "python", "jobs/instruct.py", "--input", str(tmp_path / "in.parquet"),
           "--output", str(out), "--target", str(ckpt), "--max-new-tokens", "6", "--num-actors", "1",
           "--no-progress-bars"]
    for attempt in range(2):  # ports picked free here can be taken by the new head's own components before its
        # dashboard binds (they pick free ports too): one retry with other ports when the head could not start
        proc, stdout, stderr = _submit(cmd)
        if proc.returncode == 0 or "address already in use" not in stdout + stderr:
            break
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "succeeded" in stdout + stderr
    t = pads.dataset(str(out), format="parquet").to_table()
    assert sorted(t.column("id").to_pylist()) == ["bad", "r0", "r1", "r2"]
    kinds = dict(zip(t.column("id").to_pylist(), t.column("error_kind").to_pylist()))
    assert kinds == {"bad": "media.unsupported", "r0": None, "r1": None, "r2": None}
    assert (out / "_summary.json").exists()


def _submit(cmd: list[str]) -> tuple[subprocess.Popen, str, str]:
    """Run jobs/local_cluster.sh with fresh ports; on a timeout stop its whole process group (the script's EXIT trap
    then stops its head) and fail."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "RAY_NUM_CPUS": "2",
           "RAY_PORT": str(free_port()), "RAY_DASHBOARD_PORT": str(free_port()), "RAY_CLIENT_PORT": str(free_port())}
    for name in ("RAY_ADDRESS", "RAY_DASHBOARD_AGENT_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail("the submitted job did not finish in 600 s:\n" + stdout[-3000:] + stderr[-3000:])
    return proc, stdout, stderr
