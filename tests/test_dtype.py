"""`dtype` on every entry point (`mmspec generate`, `mmspec bench`, the batch job, the Serve app) reaches the loaded
target: the model's parameters are in that dtype. One shared rule (`resolve_dtype`): auto = bfloat16 on cuda,
float32 elsewhere."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import mmspec_ray.targets
import mmspec_ray.toy.build
import mmspec_ray.toy.prompts
from mmspec_ray.batch.decoder import SpecDecoder, resolve_device
from mmspec_ray.batch.jobspec import DecodeConfig
from mmspec_ray.cli import main
from mmspec_ray.targets import Request
from mmspec_ray.targets.registry import resolve_dtype


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16 and resolve_dtype("bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="fp8"):
        resolve_dtype("fp8")
    cfg = DecodeConfig(target="x", device="cuda", s3={})
    assert resolve_device(cfg) == ("cuda", torch.bfloat16)
    assert resolve_device(cfg.model_copy(update={"dtype": "float16"})) == ("cuda", torch.float16)


@pytest.fixture
def loaded(monkeypatch) -> list:
    """Every target `mmspec` loads (the real `load_target`, recorded)."""
    seen: list = []
    real = mmspec_ray.targets.load_target

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(mmspec_ray.targets, "load_target", spy)
    return seen


@pytest.mark.parametrize("flags, dtype", [([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16),
                                          (["--dtype", "float16"], torch.float16)])
def test_generate_dtype(ckpt, loaded, capsys, flags, dtype):
    rc = main(["generate", "--target", ckpt, "--prompt", "describe the image", "--max-new-tokens", "3", *flags])
    assert rc == 0 and capsys.readouterr().out.strip()
    assert [next(t.model.parameters()).dtype for t in loaded] == [dtype] and loaded[0].dtype == dtype


def test_generate_refuses_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--target", "x", "--prompt", "hi", "--dtype", "fp8"])
    assert "--dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_bench_dtype(ckpt, loaded, monkeypatch, tmp_path):
    """`mmspec bench --dtype bfloat16` on the tiny checkpoint standing in for a toy world (one prompt, 3 tokens)."""
    monkeypatch.setattr(mmspec_ray.toy.build, "build_toy", lambda name: SimpleNamespace(target=ckpt))
    monkeypatch.setattr(mmspec_ray.toy.prompts, "toy_requests",
                        lambda *a, **k: iter([Request(prompt="describe the image")]))
    rc = main(["bench", "--drafter", "", "--assistant", "", "--prompts", "1", "--max-new-tokens", "3",
               "--repeats", "1", "--temperatures", "0", "--dtype", "bfloat16", "--out", str(tmp_path)])
    assert rc == 0
    assert [next(t.model.parameters()).dtype for t in loaded] == [torch.bfloat16]
    assert json.loads((tmp_path / "bench.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype, want", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                         ("auto", torch.float32)])
def test_serve_and_batch_dtype(ckpt, dtype, want):
    """A Serve config's `decode.dtype` (ServeSettings.decode, a DecodeConfig) is what the replica's SpecDecoder
    loads the target in (ChatServer.__init__ builds `SpecDecoder(settings.decode)`; the batch actors build the
    same SpecDecoder from the job's DecodeConfig)."""
    from mmspec_ray.serve.settings import ServeSettings

    settings = ServeSettings.model_validate({"decode": {"target": ckpt, "drafter": "none", "device": "cpu",
                                                        "dtype": dtype, "max_new_tokens": 4, "s3": {}}})
    dec = SpecDecoder(settings.decode)
    assert dec.dtype == want and next(dec.target.model.parameters()).dtype == want and dec.target.dtype == want
    out = dec.generate(Request(prompt="describe the image"))
    assert out["error"] is None and out["num_output_tokens"] > 0
