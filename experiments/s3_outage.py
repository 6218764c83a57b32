"""An S3 outage in the middle of a batch job, measured: rows with their image on a loopback S3 (moto) behind a TCP
proxy that breaks every connection for `--outage` seconds, starting `--at` seconds after the job's first S3 read. Prints, for the run
and for a re-run, the rows answered, the errors by kind and the rows decoded; writes JSON.

    .venv/bin/python experiments/s3_outage.py --rows 40 --at 1 --outage 8
    .venv/bin/python experiments/s3_outage.py --rows 40 --at 1 --outage 30 --retries 2   # past the retries: re-run
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the loopback proxy and the tiny model builders of the test suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--at", type=float, default=1.0, help="seconds after the job's first S3 media connection")
    ap.add_argument("--outage", type=float, default=8.0, help="seconds S3 stays unreachable")
    ap.add_argument("--retries", type=int, default=6, help="decode.s3.retries (default: the product default)")
    ap.add_argument("--out", default="out/s3_outage")
    a = ap.parse_args()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1", "RAY_AUTH_MODE": "disabled",
                 "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}.items():
        os.environ.setdefault(k, v)
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    from moto.server import ThreadedMotoServer
    from test_batch_safety import FlakyProxy
    from tiny import random_images, tiny_llava

    from mmspec_ray.batch import JobSpec, run_job
    from mmspec_ray.batch.cluster import start_local_ray

    tmp = Path(tempfile.mkdtemp(prefix="s3_outage_"))
    model, processor = tiny_llava()
    model.save_pretrained(tmp / "ckpt")
    processor.save_pretrained(tmp / "ckpt")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
    s3.create_bucket(Bucket="media")
    rows = []
    for i, img in enumerate(random_images(a.rows, seed=11)):
        buf = io.BytesIO()
        img.save(buf, "PNG")
        s3.put_object(Bucket="media", Key=f"{i}.png", Body=buf.getvalue())
        rows.append({"id": f"r{i}", "prompt": f"describe image {i}", "image_uri": f"s3://media/{i}.png"})
    pq.write_table(pa.Table.from_pylist(rows), tmp / "in.parquet")
    proxy = FlakyProxy(port)
    spec = JobSpec.model_validate({
        "input": str(tmp / "in.parquet"), "output": str(tmp / "out"), "progress_bars": False, "rows_per_block": 2,
        "rows_per_file": None, "decode": {"target": str(tmp / "ckpt"), "drafter": "ngram", "max_new_tokens": 32,
                                          "s3": {"endpoint_override": f"127.0.0.1:{proxy.port}", "scheme": "http",
                                                 "region": "us-east-1", "retries": a.retries}}})
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        def outage() -> None:  # `at` seconds after the job's first S3 media connection
            while proxy.first_use is None:
                time.sleep(0.05)
            time.sleep(max(0.0, proxy.first_use + a.at - time.monotonic()))
            proxy.cut()
            time.sleep(a.outage)
            proxy.restore()

        threading.Thread(target=outage, daemon=True).start()
        t0 = time.time()
        first = run_job(spec)
        results["run"] = {"wall_s": time.time() - t0, "rows_decoded": first["run"]["rows"],
                          "errors_by_kind": first["all_rows"]["errors_by_kind"],
                          "answered": first["all_rows"]["ok"], "retryable_rows": first["retryable_rows"],
                          "connections_dropped": proxy.dropped}
        while proxy.down:
            time.sleep(0.5)
        second = run_job(spec)
        results["rerun"] = {"rows_decoded": second["run"]["rows"], "retried_rows": second["retried_rows"],
                            "answered": second["all_rows"]["ok"], "errors_by_kind": second["all_rows"]["errors_by_kind"]}
    finally:
        ray.shutdown()
        proxy.close()
        server.stop()
    results["setup"] = {"rows": a.rows, "outage_at_s": a.at, "outage_s": a.outage, "retries": a.retries}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"outage_{int(a.outage)}s_retries{a.retries}.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
