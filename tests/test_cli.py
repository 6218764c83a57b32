"""`mmspec` command-line parameter errors: one line naming the flag, before any checkpoint is fetched or loaded."""

from __future__ import annotations

import pytest

import mmspec_ray.targets
import mmspec_ray.targets.registry
import mmspec_ray.toy.resolve
from mmspec_ray.cli import main


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Records any attempt to resolve, fetch or load a target (none may happen for a bad parameter)."""
    seen: list[str] = []
    for mod, name in ((mmspec_ray.toy.resolve, "resolve_target"), (mmspec_ray.targets.registry, "fetch_checkpoint"),
                      (mmspec_ray.targets, "load_target")):
        monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: seen.append(_n) or pytest.fail(f"{_n} called"))
    return seen


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1 (got 0)"),
    (["--num-frames", "-2"], "--num-frames: must be at least 1 (got -2)"),
    (["--temperature", "-1"], "--temperature: input should be greater than or equal to 0 (got -1.0)"),
    (["--top-p", "0"], "--top-p: input should be greater than 0 (got 0.0)"),
    (["--tree-tokens", "0"], "--tree-tokens: input should be greater than or equal to 1 (got 0)"),
    (["--tree-top-k", "0"], "--tree-top-k: input should be greater than or equal to 1 (got 0)"),
])
def test_generate_parameter_errors_are_one_line_before_the_model_loads(loads, capsys, flags, message):
    rc = main(["generate", "--target", "/no/such/checkpoint", "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and loads == []
    assert err == f"mmspec: error: {message}\n"
