"""Drafter training data on disk or S3: safetensors shards of target-answered examples plus a manifest.

One format for every writer (the in-process generator the toy world uses, the Ray Data job for real targets) and
every reader (the single-process trainer, the Ray Train workers). A shard carries, in its safetensors header
metadata, the ids of the input rows it covers and the errors of the rows that gave no example, so the shards alone
say which rows are done (resume) and which failed (never silently dropped). `manifest.json` lists the shards with
their example counts and is rewritten whenever a generation run ends.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from pyarrow import fs as pafs
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from mmspec_ray.batch.storage import Location, locate, write_whole
from mmspec_ray.config import S3Config

MANIFEST = "manifest.json"
LEGACY_INDEX = "index.json"  # what the in-process generator wrote before shards carried metadata
SHARD_GLOB_PREFIX = "shard-"
SHARD_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class FeatureExample:
    """One target-answered sequence. Position t of `hidden` is the target's feature after reading input_ids[:t+1]."""

    input_ids: torch.Tensor  # [L] long: prompt (media placeholders expanded) + the target's answer
    hidden: torch.Tensor  # [L, d] last post-norm hidden state (what lm_head consumes)
    embeds: torch.Tensor  # [L, d] input embeddings with media features merged
    n_prompt: int  # leading prompt positions (no loss on predicting them)
    media: torch.Tensor | None = None  # [L] bool: image/video token positions (None: features stored before it was)
    mid: torch.Tensor | None = None  # [L, d] DREAM: per position, its lowest-attention-entropy layer's output
    # [L] int: the image / frame / temporal group each position lies in (-1: text), as the target cut the prompt at
    # prefill (`TargetOutput.media_segments`); None for features stored before it was
    segments: torch.Tensor | None = None
    # [L, 3d] EAGLE-3: the target's states at its three feature layers (hs[k], the input of decoder layer k, for k in
    # `drafters.eagle3.default_feature_layers`), concatenated low, mid, high
    aux: torch.Tensor | None = None
    # [3, L] int32 M-RoPE targets with media in the prompt: the target's (temporal, height, width) position ids of
    # each position (`TargetOutput.positions`); None: position i is i
    positions: torch.Tensor | None = None
    # [n_prompt] float32 DREAM, prompts with media: the attention each prompt position receives in the target's last
    # layer at prefill (`TargetOutput.attention_received`), which ranks the visual tokens for its visual token
    # compression; None: a text-only prompt, or features stored before it was (DREAM then trains uncompressed)
    received: torch.Tensor | None = None

    def pieces(self) -> list[tuple[int, int]] | None:
        """(start, end) of each image / frame / temporal group, as the drafter meets them when it drafts (None when
        the example was stored without its segments)."""
        from mmspec_ray.targets.base import pieces_of

        return None if self.segments is None else pieces_of(self.segments)

    @property
    def multimodal(self) -> bool:
        """Whether the sequence holds any media token (text-only examples feed a two-stage method's stage 1)."""
        return self.media is None or bool(self.media.any())


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's header says: its file name, the input row ids it covers, the rows that failed."""

    name: str
    ids: list[str]
    errors: dict[str, dict[str, str]]  # id -> {"error": message, "error_kind": kind}
    examples: int
    multimodal: int  # examples holding media tokens (the rest are text-only)
    fields: frozenset[str] = frozenset()  # the example fields stored (input_ids, hidden, ..., segments)


def shard_bytes(examples: list[FeatureExample], ids: list[str] | None = None,
                errors: dict[str, dict[str, str]] | None = None) -> bytes:
    """Serialise examples (+ the row ids they came from and the rows' errors) as one safetensors file."""
    tensors: dict[str, torch.Tensor] = {}
    for j, ex in enumerate(examples):
        tensors[f"{j}.input_ids"] = ex.input_ids.contiguous()
        tensors[f"{j}.hidden"] = ex.hidden.contiguous()
        tensors[f"{j}.embeds"] = ex.embeds.contiguous()
        tensors[f"{j}.n_prompt"] = torch.tensor([ex.n_prompt])
        if ex.media is not None:
            tensors[f"{j}.media"] = ex.media.to(torch.uint8).contiguous()
        if ex.mid is not None:
            tensors[f"{j}.mid"] = ex.mid.contiguous()
        if ex.segments is not None:
            tensors[f"{j}.segments"] = ex.segments.to(torch.int32).contiguous()
        if ex.aux is not None:
            tensors[f"{j}.aux"] = ex.aux.contiguous()
        if ex.positions is not None:
            tensors[f"{j}.positions"] = ex.positions.to(torch.int32).contiguous()
        if ex.received is not None:
            tensors[f"{j}.received"] = ex.received.float().contiguous()
    meta = {"ids": json.dumps(list(ids or [])), "errors": json.dumps(errors or {}), "examples": str(len(examples)),
            "multimodal": str(sum(ex.multimodal for ex in examples))}
    return st_save(tensors, metadata=meta)


def examples_from_bytes(data: bytes) -> list[FeatureExample]:
    t = st_load(data)
    n = len({k.split(".")[0] for k in t})
    return [FeatureExample(t[f"{j}.input_ids"], t[f"{j}.hidden"], t[f"{j}.embeds"], int(t[f"{j}.n_prompt"][0]),
                           t[f"{j}.media"].bool() if f"{j}.media" in t else None, t.get(f"{j}.mid"),
                           t[f"{j}.segments"].long() if f"{j}.segments" in t else None, t.get(f"{j}.aux"),
                           t.get(f"{j}.positions"), t.get(f"{j}.received"))
            for j in range(n)]


class ShardStore:
    """A directory (local or s3://) of shards + manifest, read and written through one pyarrow filesystem."""

    def __init__(self, uri: str, s3: S3Config | None = None) -> None:
        self.loc: Location = locate(str(uri), s3 or S3Config.from_env())

    @property
    def uri(self) -> str:
        return self.loc.uri

    def _path(self, name: str) -> str:
        return f"{self.loc.path.rstrip('/')}/{name}"

    def write(self, name: str, data: bytes) -> None:
        """Write a file whole (`write_whole`), so a reader never sees half a shard."""
        write_whole(self.loc.child(name), data)

    def read(self, name: str) -> bytes:
        with self.loc.fs.open_input_stream(self._path(name)) as f:
            return f.read()

    def exists(self, name: str) -> bool:
        return self.loc.fs.get_file_info(self._path(name)).type != pafs.FileType.NotFound

    def shard_names(self) -> list[str]:
        sel = pafs.FileSelector(self.loc.path, allow_not_found=True)
        names = [i.base_name for i in self.loc.fs.get_file_info(sel) if i.type == pafs.FileType.File]
        return sorted(n for n in names if n.startswith(SHARD_GLOB_PREFIX) and n.endswith(SHARD_SUFFIX))

    def write_shard(self, name: str, examples: list[FeatureExample], ids: list[str] | None = None,
                    errors: dict[str, dict[str, str]] | None = None) -> None:
        self.write(name, shard_bytes(examples, ids, errors))

    def shard_info(self, name: str) -> ShardInfo:
        """The shard's header metadata, read without its tensors (8-byte length + JSON header)."""
        with self.loc.fs.open_input_file(self._path(name)) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        meta = header.get("__metadata__", {})
        count = meta.get("examples")
        examples = int(count) if count is not None else len({k.split(".")[0] for k in header if k != "__metadata__"})
        multimodal = int(meta.get("multimodal", examples))
        fields = frozenset(k.split(".", 1)[1] for k in header if k != "__metadata__")
        return ShardInfo(name, json.loads(meta.get("ids", "[]")), json.loads(meta.get("errors", "{}")), examples,
                         multimodal, fields)

    def load_shard(self, name: str) -> list[FeatureExample]:
        return examples_from_bytes(self.read(name))

    def write_manifest(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Rewrite manifest.json from the shards present now (+ `extra`: recipe, target ...)."""
        infos = [self.shard_info(n) for n in self.shard_names()]
        answered = {r for i in infos for r in i.ids if r not in i.errors}  # a retried row may also have failed before
        manifest = {**extra, "shards": [i.name for i in infos],
                    "examples_per_shard": [i.examples for i in infos],
                    "multimodal_per_shard": [i.multimodal for i in infos],
                    "examples": sum(i.examples for i in infos),
                    "rows": len({r for i in infos for r in i.ids}),
                    "errors": {k: v for i in infos for k, v in i.errors.items() if k not in answered}}
        self.write(MANIFEST, json.dumps(manifest, indent=1).encode())
        return manifest

    def manifest(self) -> dict[str, Any]:
        for name in (MANIFEST, LEGACY_INDEX):
            if self.exists(name):
                return json.loads(self.read(name))
        raise FileNotFoundError(f"{self.uri} has no {MANIFEST}; generate the training data first "
                                "(mmspec train-drafter --data ..., or jobs/train_drafter.py)")

    def load_all(self) -> list[FeatureExample]:
        """Every example the manifest lists, in shard order."""
        return [ex for name in self.manifest()["shards"] for ex in self.load_shard(name)]
