"""A drafter directory's files, read so that every failure is one line naming the drafter, the file and what to do:
a config.json that is missing or not JSON, a weight file that is truncated or not a weight file at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # a trained drafter's; a released head's
SMALL_KEYS = ("d2t", "t2d")  # tensors whose values (not only shapes) a check needs: read even from headers alone


class DrafterError(ValueError):
    """A drafter that cannot be used: one line naming its directory, the file or field at fault and what to do."""


class TargetMismatch(DrafterError):
    """A drafter whose files are sound, made for another target: one line naming what differs, both sides."""


def first_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first sentence of its message's first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].split('. ')[0].rstrip('.')}" if text else type(e).__name__


def read_config(path: Path) -> dict[str, Any]:
    """The drafter's config.json as a dict, or a DrafterError naming the file when it is missing or not a JSON
    object."""
    f = Path(path) / "config.json"
    if not f.exists():
        raise DrafterError(f"drafter {path} has no config.json: give a drafter checkpoint directory (train one "
                           "with `mmspec train-drafter`, or copy a released head with its config.json)")
    try:
        config = json.loads(f.read_text())
    except (ValueError, OSError) as e:
        raise DrafterError(f"drafter {path}: config.json cannot be read ({first_line(e)}): restore the config.json "
                           "the drafter was saved or published with") from None
    if not isinstance(config, dict):
        raise DrafterError(f"drafter {path}: config.json holds a {type(config).__name__}, not a JSON object: restore "
                           "the config.json the drafter was saved or published with")
    return config


def parse_config(model: type[M], path: Path, config: dict[str, Any]) -> M:
    """A drafter's config.json as `model` (its head's config class), a bad field refused in one line naming it."""
    try:
        return model(**config)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise DrafterError(f"drafter {path}: config.json field {where}: {err['msg'].lower()} (got "
                           f"{err.get('input')!r}): restore the config.json saved with the drafter") from None


def weight_file(path: Path) -> str | None:
    """The name of the drafter's weight file (model.safetensors first), or None when it has none."""
    return next((f for f in WEIGHT_FILES if (Path(path) / f).exists()), None)


def _unreadable(path: Path, name: str, e: BaseException) -> DrafterError:
    return DrafterError(f"drafter {path}: weight file {name} cannot be read ({first_line(e)}); it is truncated or "
                        "not a weight file: copy or download the drafter again")


def read_state(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The whole state dict of a safetensors or torch .bin weight file (tensors only, never pickled code)."""
    try:
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(str(Path(path) / name))
        else:
            state = torch.load(Path(path) / name, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip or safetensors file, an empty file, a pickle that is not tensors
        raise _unreadable(path, name, e) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DrafterError(f"drafter {path}: weight file {name} holds no state dict of tensors: save the head's "
                           "state_dict (torch.save or safetensors)")
    return state


def read_meta(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The weight file's tensors for checking, not computing: shapes on the meta device (from a safetensors header
    alone, which also proves the file whole) and the values of SMALL_KEYS; a .bin file is read whole."""
    if not name.endswith(".safetensors"):
        return read_state(path, name)
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(Path(path) / name), framework="pt") as f:
            for k in f.keys():
                if k in SMALL_KEYS:
                    out[k] = f.get_tensor(k)
                else:
                    s = f.get_slice(k)
                    out[k] = torch.empty(s.get_shape(), dtype=_DTYPES.get(s.get_dtype(), torch.float32),
                                         device="meta")
    except Exception as e:  # safetensors refuses a header whose tensors run past the end of the file
        raise _unreadable(path, name, e) from None
    return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
