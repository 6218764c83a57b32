"""One reading of `--target` for `mmspec generate` and the batch jobs (toy name, s3:// URI, local path), a family
module that cannot be imported is named instead of silently skipped, and S3 tests fail rather than skip without moto."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import mmspec_ray.targets.registry as registry
from conftest import require
from mmspec_ray.batch.cli import resolve_target as batch_resolve
from mmspec_ray.cli import main
from mmspec_ray.targets import TargetError
from mmspec_ray.toy.resolve import resolve_target
from tiny import random_images


def test_resolver_keeps_s3_uris_and_builds_toy_worlds(monkeypatch, tmp_path):
    import mmspec_ray.toy.build as build

    built = []
    monkeypatch.setattr(build, "build_toy", lambda name: built.append(name) or type("W", (), {"target": tmp_path})())
    for resolve in (resolve_target, batch_resolve):
        assert resolve("s3://bucket/ckpts/x") == "s3://bucket/ckpts/x"
        assert resolve("/models/llava") == "/models/llava"
        assert resolve("toy-s") == str(tmp_path)
    assert built == ["toy-s", "toy-s"]


def test_generate_reads_an_s3_target_like_a_local_one(s3_server, ckpt, tmp_path, monkeypatch, capsys):
    """`mmspec generate --target s3://...` downloads the checkpoint (endpoint from AWS_ENDPOINT_URL) and answers
    exactly as the local copy does."""
    monkeypatch.setenv("MMSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    bucket = s3_server.new_bucket()
    for f in sorted(Path(ckpt).iterdir()):
        s3_server.put(bucket, f"models/tiny/{f.name}", f.read_bytes())
    image = tmp_path / "x.png"
    random_images(1, seed=3)[0].save(image)
    args = ["generate", "--prompt", "describe the image", "--image", str(image), "--max-new-tokens", "6"]
    assert main(args + ["--target", ckpt]) == 0
    local = capsys.readouterr().out
    assert main(args + ["--target", f"s3://{bucket}/models/tiny"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == local and local.strip()


def test_a_family_module_that_fails_to_import_is_named(monkeypatch, caplog):
    monkeypatch.setattr(registry, "FAMILY_MODULES", ("llava", "no_such_family", "gemma3"))
    monkeypatch.setattr(registry, "_FAMILIES", {})
    monkeypatch.setattr(registry, "_BROKEN", {})
    monkeypatch.setattr(registry, "_loaded", False)
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        fams = registry.families()
    assert {"llava", "gemma3"} <= set(fams)  # the families after the broken one still load
    assert "no_such_family is unavailable" in caplog.text and "ModuleNotFoundError" in caplog.text
    with pytest.raises(TargetError, match=r"failed to import: no_such_family \(ModuleNotFoundError"):
        registry.adapter_for(type("M", (), {"config": type("C", (), {"model_type": "mystery"})()})())


def test_a_missing_test_dependency_fails_instead_of_skipping():
    with pytest.raises(pytest.fail.Exception, match="no_such_module_for_s3_tests is missing"):
        require("no_such_module_for_s3_tests")
    assert require("moto.server").ThreadedMotoServer
