"""Shared fixtures: a real S3 endpoint on loopback (moto's threaded server), reusable by any test file."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from mmspec_ray.config import S3Config

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # Never wait on the EC2 metadata service, and never send loopback traffic through a proxy.
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def pytest_configure(config) -> None:
    """Tiny models are dominated by per-op overhead: one intra-op thread is as fast on an idle 2-core machine and
    many times faster on a loaded one (thread oversubscription). Tree calibrations go to a directory of the run."""
    import tempfile

    import torch

    torch.set_num_threads(1)
    _hypothesis_profile()
    # tree calibrations of the suite's throwaway checkpoints stay out of the user's cache (Ray workers inherit it)
    os.environ["MMSPEC_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="mmspec-calibration-")


def _hypothesis_profile() -> None:
    """Property tests draw the same examples on every run (`derandomize`), so a red test is red again on the next
    run and on any machine; MMSPEC_HYPOTHESIS_EXPLORE=1 draws fresh ones (a failure prints its reproduce blob)."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("fixed", derandomize=True, print_blob=True)
    settings.register_profile("explore", print_blob=True)
    settings.load_profile("explore" if os.environ.get("MMSPEC_HYPOTHESIS_EXPLORE") == "1" else "fixed")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark every test that trains a drafter (`train_drafter(` in its body) `trained`: the test command runs those
    again under a non-native ATEN_CPU_CAPABILITY, so a test whose outcome rests on kernel rounding cannot land."""
    import inspect

    for item in items:
        fn = getattr(item, "function", None)
        try:
            src = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            src = ""
        if "train_drafter(" in src:
            item.add_marker(pytest.mark.trained)


@dataclass
class S3Server:
    """A running moto S3 server on 127.0.0.1 plus what a test needs to talk to it."""

    host: str
    port: int
    client: Any  # boto3 S3 client bound to the server
    _ids: itertools.count = field(default_factory=itertools.count, repr=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def s3_config(self) -> S3Config:
        """What `mmspec_ray` code (pyarrow S3FileSystem) needs to reach this server."""
        return S3Config(endpoint_override=f"{self.host}:{self.port}", scheme="http", region="us-east-1")

    def new_bucket(self, prefix: str = "bucket") -> str:
        """Create a fresh, uniquely named bucket (the server is shared by the whole session)."""
        name = f"{prefix}-{os.getpid()}-{next(self._ids)}"
        self.client.create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Upload `data` and return its s3:// URI."""
        self.client.put_object(Bucket=bucket, Key=key, Body=data)
        return f"s3://{bucket}/{key}"


def require(module: str):
    """Import a test dependency or fail the test that needs it (never a quiet skip: a missing moto would otherwise
    turn every S3 test into a skip and the suite green)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"test dependency {module} is missing ({e}); install the dev extras: pip install -e '.[dev]'",
                    pytrace=False)


@pytest.fixture(scope="session")
def s3_server():
    """Session-wide moto S3 server on an ephemeral loopback port, with fake credentials in the environment.

    Yields an `S3Server` with `.endpoint_url`, `.s3_config`, `.client`, `.new_bucket()` and `.put()`.
    """
    require("moto.server")
    boto3 = require("boto3")
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for k, v in _S3_ENV.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(k, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            client = boto3.client(
                "s3",
                endpoint_url=f"http://{host}:{port}",
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            )
            yield S3Server(host=host, port=port, client=client)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def ray_cluster(s3_server):
    """A 2-CPU local Ray for the requesting module (no dashboard), shut down after it. Started after the S3 fixture
    so that workers inherit its credentials."""
    ray = pytest.importorskip("ray")
    from mmspec_ray.batch.cluster import start_local_ray

    os.environ["RAY_DATA_DISABLE_PROGRESS_BARS"] = "1"
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> str:
    """A tiny random-init LLaVA saved with save_pretrained (model + processor): a checkpoint directory that
    `load_target` loads exactly like a real one."""
    from tiny import tiny_llava

    path = tmp_path_factory.mktemp("tiny_llava_ckpt")
    model, processor = tiny_llava()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)
