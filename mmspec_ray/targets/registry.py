"""Target registry and `load_target`: local directory or s3:// checkpoint -> the family's adapter."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from mmspec_ray.config import S3Config, mmspec_home
from mmspec_ray.targets.base import TargetError, VLMTarget
from mmspec_ray.targets.layout import CheckpointLayout, read_layout

log = logging.getLogger(__name__)
_FAMILIES: dict[str, type[VLMTarget]] = {}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)  # what every entry point's `dtype` accepts


def resolve_device_name(device: str | torch.device) -> str | torch.device:
    """The device a target is loaded on: "auto" is cuda when a GPU is visible, else cpu; anything else as given."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype a target is loaded in: a name in DTYPE_NAMES or a torch dtype; "auto" (or None) means
    bfloat16 on cuda and float32 elsewhere. Only float32 gives HF generate's greedy output token for token in
    every case (docs/design.md, "Precision")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[dtype]


def register(cls: type[VLMTarget]) -> type[VLMTarget]:
    for mt in cls.model_types:
        _FAMILIES[mt] = cls
    return cls


def families() -> dict[str, type[VLMTarget]]:
    _load_builtin()
    return dict(_FAMILIES)


# One module per family; each defines ADAPTERS, a tuple of VLMTarget subclasses.
FAMILY_MODULES = ("llava", "llava_next", "llava_next_video", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                  "idefics3", "gemma3", "internvl", "mistral3", "glm4v")
# The generic adapter and its self-check (any other image-text-to-text checkpoint), imported on first use: its
# self-check runs the decoding engine, which sits below this registry.
GENERIC_MODULE = "mmspec_ray.targets.generic"
_BROKEN: dict[str, str] = {}  # family module -> why it could not be imported
_loaded = False


def _load_builtin() -> None:
    """Import every family module once. One that fails is logged with its error and named by `unsupported`, never
    skipped without a word (nor does it stop the families after it from loading)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in FAMILY_MODULES:
        full = f"mmspec_ray.targets.{name}"
        try:
            adapters = importlib.import_module(full).ADAPTERS
        except Exception as e:  # ImportError, or any error raised while the module runs
            _BROKEN[name] = f"{type(e).__name__}: {e}"
            log.warning("target family %s is unavailable: %s cannot be imported (%s)", name, full, _BROKEN[name])
            continue
        for cls in adapters:
            register(cls)


def unsupported(model_type: str | None) -> str:
    """The error text for a model type without an adapter: the supported ones, and any family that failed to load."""
    msg = f"model type {model_type!r} has no target adapter; supported: {sorted(families())}"
    if _BROKEN:
        msg += "; family modules that failed to import: " + "; ".join(f"{k} ({v})" for k, v in _BROKEN.items())
    return msg


def adapter_for(model) -> type[VLMTarget]:
    mt = model.config.model_type
    fam = families()
    if mt not in fam:
        raise TargetError(unsupported(mt))
    return fam[mt]


def generic_module():
    """mmspec_ray.targets.generic: the generic adapter, `wrap_generic` and its self-check."""
    return importlib.import_module(GENERIC_MODULE)


def wrap(model, processor, feature_layers: tuple[int, ...] = (), generic: bool = False) -> VLMTarget:
    """Adapter around an already loaded model + processor: its family's, else (or with `generic=True`) the generic
    adapter, which must first pass its self-check (`targets/generic.py`)."""
    if not generic and model.config.model_type in families():
        return adapter_for(model)(model, processor, feature_layers)
    mod = generic_module()
    if not mod.is_image_text_to_text(model.config.model_type):
        raise TargetError(not_generic(model.config.model_type))
    return mod.wrap_generic(model, processor, feature_layers)


def not_generic(model_type: str | None) -> str:
    """The error text for a model type with no adapter that the generic adapter cannot take either."""
    return (f"{unsupported(model_type)}; nor can the generic adapter take it: it loads image-text-to-text models "
            "only, and transformers' AutoModelForImageTextToText has no class for this model type")


def load_target(path_or_uri: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None,
                feature_layers: tuple[int, ...] = (), s3: S3Config | None = None, generic: bool = False) -> VLMTarget:
    """Load a checkpoint (local directory or s3://bucket/prefix) with the stock Auto classes and wrap it.
    `device`: a torch device or "auto" (`resolve_device_name`); `dtype`: a torch dtype or a name (auto, float32,
    bfloat16, float16; see `resolve_dtype`); None: float32. A model type without an adapter of its own gets the
    generic adapter if it is an image-text-to-text model whose processor has a chat template, and only once that
    adapter has passed its self-check on this checkpoint; `generic=True` takes that path for any checkpoint."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = fetch_checkpoint(str(path_or_uri), s3)
    check_checkpoint(path)
    # Unsupported families fail here, before any weights are read (AutoModel's own error is a list of 100 classes).
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    named = not generic and model_type in families()
    if not named and not generic_module().is_image_text_to_text(model_type):
        raise TargetError(f"checkpoint {path}: {not_generic(model_type)}")
    try:
        processor = AutoProcessor.from_pretrained(path)
    except Exception as e:  # ImportError / OSError / ValueError, depending on which sub-processor failed
        needs = "its video processor" if "videoprocessor" in str(e).lower() else "it"
        hint = (f" ({needs} needs torchvision: install the torchvision build matching torch)"
                if "torchvision" in str(e).lower() else "")
        raise TargetError(f"cannot load the {model_type} processor saved in {path}{hint}: "
                          f"{type(e).__name__}: {str(e).strip()}") from e
    if getattr(processor, "image_processor", None) is None:
        # AutoProcessor quietly falls back to the bare tokenizer when processor_config.json names a class that
        # transformers does not know; images would then be dropped without an error.
        pc = _processor_class(path)
        why = f"processor_class {pc!r} is not a transformers class" if pc else "no processor class is saved"
        raise TargetError(f"checkpoint {path}: AutoProcessor loaded only a {type(processor).__name__}, not a "
                          f"multimodal processor ({why}); save the stock processor next to the model "
                          "(processor.save_pretrained)")
    if not named and not generic_module().chat_template_of(processor):
        raise TargetError(f"checkpoint {path}: the generic adapter needs a chat template, and the "
                          f"{type(processor).__name__} saved there has none; save one with the processor "
                          f"(processor.chat_template), or use a supported family: {sorted(families())}")
    device = resolve_device_name(device)
    dtype = torch.float32 if dtype is None else resolve_dtype(dtype, device)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device)
    try:
        target = wrap(model, processor, feature_layers, generic=generic)
    except TargetError as e:  # the same kind (a failed self-check stays SelfCheckFailed), naming the checkpoint
        raise type(e)(f"checkpoint {path}: {e}") from e
    target.checkpoint = str(path)
    return target


def check_loadable(uri: str, s3: S3Config | None = None) -> CheckpointLayout:
    """What `load_target` would refuse, found from the file names, config and safetensors headers alone (no weights
    read, no download), so a job says it in one line before any actor starts: a missing config or weights, a
    model type that neither has an adapter nor is an image-text-to-text one (the generic adapter's), no tokenizer
    or no image processor saved next to the model. The generic adapter's self-check runs when the target loads."""
    layout = read_layout(uri, s3)
    if layout.model_type not in families() and not generic_module().is_image_text_to_text(layout.model_type):
        raise TargetError(f"checkpoint {uri}: {not_generic(layout.model_type)}")
    files = set(layout.files)
    if not files & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
        raise TargetError(f"checkpoint {uri} has no tokenizer files; save the processor next to the model "
                          "(processor.save_pretrained)")
    if not files & {"preprocessor_config.json", "processor_config.json"}:
        raise TargetError(f"checkpoint {uri} has no image processor (preprocessor_config.json); save the stock "
                          "processor next to the model (processor.save_pretrained)")
    return layout


def _processor_class(path: Path) -> str | None:
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        f = path / name
        if f.exists() and (cls := json.loads(f.read_text()).get("processor_class")):
            return cls
    return None


def check_checkpoint(path: Path) -> None:
    """Fail early, naming the missing file, when a checkpoint directory is incomplete."""
    if not path.is_dir():
        raise TargetError(f"checkpoint {path} does not exist or is not a directory")
    if not (path / "config.json").exists():
        raise TargetError(f"checkpoint {path} has no config.json; is this a save_pretrained directory?")
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(s for s in shards if not (path / s).exists())
        if missing:
            raise TargetError(f"checkpoint {path} is incomplete: missing weight shards {missing}")
    elif not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise TargetError(f"checkpoint {path} has no weights (model.safetensors)")
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise TargetError(f"checkpoint {path} has no tokenizer files; save the processor next to the model")


def checkpoint_cache() -> Path:
    home = mmspec_home()
    return home / "checkpoints"


def fetch_checkpoint(uri: str, s3: S3Config | None = None, check: Callable[[Path], None] | None = None,
                     refresh: bool = False) -> Path:
    """Local paths pass through; s3://bucket/prefix is mirrored into the local cache once (resumable per file) and
    checked by `check` (default: a target checkpoint's files, `check_checkpoint`). `refresh`: download every file
    again (small checkpoints that may be re-published under the same prefix: drafters)."""
    if not uri.startswith("s3://"):
        return Path(uri[len("file://"):] if uri.startswith("file://") else uri)
    from pyarrow import fs

    from mmspec_ray.media.io import s3_filesystem

    s3 = s3 or S3Config.from_env()
    key = uri[len("s3://"):].rstrip("/")
    dest = checkpoint_cache() / hashlib.sha256(f"{s3.endpoint_override}|{key}".encode()).hexdigest()[:16]
    done = dest / ".mmspec-complete"
    if done.exists() and not refresh:
        return dest
    s3fs = s3_filesystem(s3)
    try:
        infos = s3fs.get_file_info(fs.FileSelector(key, recursive=True, allow_not_found=True))
    except OSError as e:
        raise TargetError(f"cannot list {uri}: {e}") from e
    files = [i for i in infos if i.type == fs.FileType.File]
    if not files:
        raise TargetError(f"no checkpoint files under {uri}")
    dest.mkdir(parents=True, exist_ok=True)
    for info in files:
        rel = info.path[len(key):].lstrip("/")
        out = dest / rel
        if out.exists() and out.stat().st_size == info.size and not refresh:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".part")
        with s3fs.open_input_stream(info.path) as src, open(tmp, "wb") as f:
            while chunk := src.read(8 << 20):
                f.write(chunk)
        tmp.rename(out)
    log.info("downloaded %d files from %s to %s", len(files), uri, dest)
    try:
        (check or check_checkpoint)(dest)
    except TargetError as e:  # name the URI the user gave, not only the cache directory
        raise TargetError(f"{uri} is not a complete checkpoint: {e}") from e
    done.write_text("ok\n")
    return dest
