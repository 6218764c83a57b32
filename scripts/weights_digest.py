"""SHA-256 over a checkpoint's tensors (names, dtypes, shapes, bytes), whatever wrote the file: to check that a toy
world rebuilt elsewhere (e.g. toy-m grown on a GPU machine) holds the same weights as the one measured here.
`python scripts/weights_digest.py DIR_OR_SAFETENSORS`"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def digest(path: Path) -> str:
    f = path / "model.safetensors" if path.is_dir() else path
    h = hashlib.sha256()
    with safe_open(str(f), framework="pt") as st:
        for name in sorted(st.keys()):
            t = st.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    print(digest(Path(sys.argv[1])))
