"""What a checkpoint is, read without loading it: its config, its tensors' names, dtypes and shapes (from the
safetensors headers), the parameter count, the KV bytes a token costs, and an identity that stays the same wherever
the checkpoint is copied. Reads only config.json, each safetensors header and a few bytes of each tensor, locally
or by ranged reads on S3, so a job can plan (and refuse) before any actor loads weights."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from mmspec_ray.config import S3Config
from mmspec_ray.targets.request import TargetError

# config keys that say where or how a copy was saved, not what the model is
_VOLATILE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"}
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1}
SAMPLE = 16  # leading elements of every tensor that enter the identity


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name (BF16, F32, ...)
    shape: tuple[int, ...]
    file: str  # the shard holding it
    start: int  # byte offset of its data in that file


@dataclass(frozen=True)
class CheckpointLayout:
    """A checkpoint's config and tensor table, and what follows from them."""

    uri: str
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    files: tuple[str, ...] = ()  # the file names at the checkpoint's top level

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def parameters(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())

    def weight_bytes(self, dtype_bytes: int) -> int:
        """The weights' size once loaded in a dtype of `dtype_bytes` bytes per element."""
        return self.parameters * dtype_bytes

    def full_config(self) -> dict[str, Any]:
        """The config with the model class's defaults filled in (a hub config may leave most of text_config out)."""
        return normalised_config(self.config)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token over every decoder layer of the language model."""
        full = self.full_config()
        tc = full.get("text_config") or full
        layers = int(tc.get("num_hidden_layers") or 0)
        heads = int(tc.get("num_attention_heads") or 1)
        kv = int(tc.get("num_key_value_heads") or heads)
        head_dim = int(tc.get("head_dim") or int(tc.get("hidden_size") or 0) // max(1, heads))
        return 2 * layers * kv * head_dim * dtype_bytes


def normalised_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as transformers completes it (`AutoConfig.for_model`: every default written out, so a sparse hub
    config and its re-saved copy agree); the raw dict where transformers does not know the model type."""
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in config.items() if k != "model_type"}
        return AutoConfig.for_model(config["model_type"], **fields).to_dict()
    except Exception:  # an unknown model type or a config transformers rejects: hash what is there
        return dict(config)


class _Reader:
    """Byte ranges of the checkpoint's files, local or on S3."""

    def __init__(self, uri: str, s3: S3Config | None) -> None:
        from mmspec_ray.media.io import filesystem_for

        self.uri = uri.rstrip("/")
        self.fs, self.root = filesystem_for(uri, s3)

    def names(self) -> list[str]:
        from pyarrow import fs

        try:
            if self.fs.get_file_info(self.root).type != fs.FileType.Directory:
                raise TargetError(f"checkpoint {self.uri} does not exist or is not a directory")
            infos = self.fs.get_file_info(fs.FileSelector(self.root, recursive=False, allow_not_found=True))
        except OSError as e:
            raise TargetError(f"cannot list {self.uri}: {e}") from e
        return sorted(i.base_name for i in infos if i.type == fs.FileType.File)

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        return self.read_many(name, [(start, length)])[0]

    def read_many(self, name: str, ranges: list[tuple[int, int | None]]) -> list[bytes]:
        """Several byte ranges of one file, opened once (one S3 object handle for all of a shard's tensors)."""
        with self.fs.open_input_file(f"{self.root}/{name}") as f:
            out = []
            for start, length in ranges:
                f.seek(start)
                out.append(f.read() if length is None else f.read(length))
            return out


def _header(reader: _Reader, name: str) -> tuple[dict[str, Any], int]:
    """(the safetensors header of file `name`, the byte offset where its data starts)."""
    head = reader.read(name, 0, 8)
    if len(head) < 8:
        raise TargetError(f"checkpoint {reader.uri}: {name} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    if n > 100 << 20:
        raise TargetError(f"checkpoint {reader.uri}: {name} has an implausible safetensors header ({n} bytes)")
    try:
        return json.loads(reader.read(name, 8, n)), 8 + n
    except ValueError as e:
        raise TargetError(f"checkpoint {reader.uri}: {name} has an unreadable safetensors header: {e}") from e


def read_layout(uri: str, s3: S3Config | None = None) -> CheckpointLayout:
    """Config and tensor table of the checkpoint at `uri` (a local directory or s3://bucket/prefix). Raises
    `TargetError` naming what is missing (config.json, weights in safetensors)."""
    reader = _Reader(uri, s3)
    names = reader.names()
    if "config.json" not in names:
        raise TargetError(f"checkpoint {uri} has no config.json; is this a save_pretrained directory?")
    config = json.loads(reader.read("config.json"))
    index = "model.safetensors.index.json"
    if index in names:  # the shards the index names, not every safetensors file that happens to sit there
        shards = sorted(set(json.loads(reader.read(index))["weight_map"].values()))
        missing = sorted(set(shards) - set(names))
        if missing:
            raise TargetError(f"checkpoint {uri} is incomplete: missing weight shards {missing}")
    else:
        shards = [n for n in ("model.safetensors",) if n in names] or sorted(
            n for n in names if n.endswith(".safetensors"))
    if not shards:
        raise TargetError(f"checkpoint {uri} has no safetensors weights (model.safetensors or its shards)")
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        header, data = _header(reader, shard)
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            tensors[key] = TensorInfo(meta["dtype"], tuple(meta["shape"]), shard, data + meta["data_offsets"][0])
    return CheckpointLayout(uri, config, tensors, tuple(names))


def checkpoint_identity(uri: str, s3: S3Config | None = None, layout: CheckpointLayout | None = None) -> str:
    """A digest of what the checkpoint is: its config as transformers completes it (without where or in which dtype
    it was saved) and every tensor's shape and first values (rounded to bfloat16, so a float32 and a bfloat16 copy of
    the same weights agree; names are left out, which transformers versions rename). The same wherever the
    checkpoint is copied or re-saved; a fine-tune of the same base differs."""
    import torch

    layout = layout or read_layout(uri, s3)
    reader = _Reader(uri, s3)
    h = hashlib.sha256()
    config = {k: v for k, v in normalised_config(layout.config).items() if k not in _VOLATILE}
    for sub in ("text_config", "vision_config"):
        if isinstance(config.get(sub), dict):
            config[sub] = {k: v for k, v in config[sub].items() if k not in _VOLATILE}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    keys = sorted(layout.tensors)
    wanted: dict[str, list[str]] = {}
    for key in keys:
        t = layout.tensors[key]
        if _BYTES.get(t.dtype) and math.prod(t.shape):
            wanted.setdefault(t.file, []).append(key)
    raw_of: dict[str, bytes] = {}
    for file, names in wanted.items():
        ranges = [(layout.tensors[k].start, min(SAMPLE, math.prod(layout.tensors[k].shape)) *
                   _BYTES[layout.tensors[k].dtype]) for k in names]
        raw_of.update(zip(names, reader.read_many(file, ranges)))
    items = []  # (shape, sample) per tensor: names are left out, since transformers versions rename keys
    for key in keys:
        t = layout.tensors[key]
        raw = raw_of.get(key, b"")
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}.get(t.dtype)
        if raw and dtype is not None:
            raw = torch.frombuffer(bytearray(raw), dtype=dtype).float().to(torch.bfloat16).view(torch.int16).numpy()\
                .tobytes()
        items.append((str(t.shape).encode(), raw))
    for shape, sample in sorted(items):
        h.update(shape + b"|" + sample)
    return h.hexdigest()[:20]


# files beside the weights that change what the checkpoint answers: its stop ids and penalties, its tokenizer and
# chat template, its image / video processing
ANSWER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.json",
                "chat_template.jinja", "preprocessor_config.json", "processor_config.json",
                "video_preprocessor_config.json")


def answer_files_digest(uri: str, s3: S3Config | None = None) -> str:
    """A digest of the checkpoint's files other than config and weights that shape its answers (`ANSWER_FILES`, by
    name and content): what `checkpoint_identity` leaves out, for keys of stored answers."""
    reader = _Reader(uri, s3)
    h = hashlib.sha256()
    for name in sorted(set(reader.names()) & set(ANSWER_FILES)):
        h.update(name.encode() + b"\0" + hashlib.sha256(reader.read(name)).digest())
    return h.hexdigest()

