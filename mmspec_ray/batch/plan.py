"""The plan a batch job prints before it starts (and `--dry-run` prints alone): resources that follow the cluster
(`gpus_per_actor: auto` takes one GPU per actor where the cluster has GPUs, CPU where it has none), a GPU probe on
the workers (a cluster that offers GPUs to Ray while torch there sees no CUDA is refused), the memory the target
needs against the device's (refused before any row is read when it cannot fit), the drafter and why, the tree, the
rows. Reads the checkpoint's config and safetensors headers only: no model is loaded."""

from __future__ import annotations

import logging
from typing import Any

import ray

from mmspec_ray.batch.jobspec import DecodeConfig, JobSpec
from mmspec_ray.batch.storage import JobInputError
from mmspec_ray.targets.layout import CheckpointLayout
from mmspec_ray.targets.registry import check_loadable
from mmspec_ray.targets.request import TargetError

log = logging.getLogger(__name__)

PROMPT_ALLOWANCE = 8192  # prompt tokens budgeted per request in the KV estimate (images or frames and text)
HEADROOM = 1.15  # activations, the drafter and the allocator's slack over weights + KV
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROBE_TIMEOUT_S = 180.0


def auto_gpus(gpus: float | str, device: str) -> float:
    """GPUs per decoder (batch actor or Serve replica): a number stays; `auto` is 1 where the connected Ray cluster
    has GPUs (ray.cluster_resources) and the decode device is not the CPU, else 0."""
    if gpus != "auto":
        return float(gpus)
    if device.startswith("cpu") or not ray.is_initialized():
        return 0.0
    return 1.0 if float(ray.cluster_resources().get("GPU", 0.0)) > 0 else 0.0


def resolve_gpus(spec: JobSpec) -> float:
    """GPUs per actor of a batch job (`auto_gpus`)."""
    return auto_gpus(spec.gpus_per_actor, spec.decode.device)


@ray.remote(num_cpus=0)
def _gpu_probe() -> dict[str, Any]:
    """Runs where an actor would (holding its GPUs): what torch sees there."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False, "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    return {"cuda": True, "torch": torch.__version__, "name": props.name, "memory": int(props.total_memory)}


def probe_gpu(gpus: float, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any] | None:
    """What torch sees on a worker holding `gpus` GPUs, or None when no GPU was granted in `timeout_s` (an
    autoscaler adding GPU nodes): the job goes on and its actors wait for the nodes as before."""
    ref = _gpu_probe.options(num_gpus=gpus).remote()
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
        log.warning("no GPU worker answered within %.0f s; the actors will wait for the autoscaler", timeout_s)
        return None
    return ray.get(ref)


def check_gpu(gpus: float, probe: dict[str, Any] | None) -> None:
    """A cluster that grants GPUs to Ray while torch there has no CUDA would decode on nothing: refuse."""
    if gpus > 0 and probe is not None and not probe["cuda"]:
        raise JobInputError(
            f"the cluster offers GPUs to Ray, but torch {probe['torch']} on the GPU worker sees no CUDA device: "
            "install a CUDA build of torch on the workers (TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 "
            "bash scripts/bootstrap.sh; docs/getting-started.md), or decode on CPU with --gpus-per-actor 0")


def check_drafter(cfg: DecodeConfig) -> None:
    """A drafter directory that cannot run on the target (unreadable files, a config or weights it was not saved
    with, another target's sizes or family), refused in one line from its files and the target's config alone."""
    from mmspec_ray.drafters.facts import facts_from_layout
    from mmspec_ray.drafters.preflight import check_drafter as check, needs_check

    if not needs_check(cfg.drafter):
        return
    try:
        layout = check_loadable(cfg.target, cfg.s3)
    except (TargetError, OSError, ValueError, KeyError) as e:
        raise JobInputError(f"target: {e}") from e
    try:
        check(cfg.drafter, facts_from_layout(layout, cfg.s3), cfg.s3)
    except (ValueError, TargetError, OSError) as e:  # DrafterError is a ValueError
        raise JobInputError(str(e)) from e


def memory_need(layout: CheckpointLayout, dtype: str, max_new_tokens: int) -> dict[str, float]:
    """GiB a decoder needs: weights in `dtype`, KV at PROMPT_ALLOWANCE + max_new_tokens tokens, and the total with
    HEADROOM."""
    size = DTYPE_BYTES[dtype]
    weights = layout.weight_bytes(size) / 2**30
    kv = layout.kv_bytes_per_token(size) * (PROMPT_ALLOWANCE + max_new_tokens) / 2**30
    return {"weights_gib": round(weights, 4), "kv_gib": round(kv, 4), "need_gib": round((weights + kv) * HEADROOM, 4)}


def check_memory(need: dict[str, float], gpus: float, probe: dict[str, Any] | None) -> float | None:
    """GiB an actor has on its GPU share (None: unknown); refuses a target that cannot fit there."""
    if gpus <= 0 or probe is None or not probe.get("cuda"):
        return None
    have = probe["memory"] / 2**30 * min(gpus, 1.0)
    if need["need_gib"] > have:
        share = f"{gpus:g} of a {probe['memory'] / 2**30:.0f} GiB {probe['name']}" if gpus < 1 else \
            f"a {probe['memory'] / 2**30:.0f} GiB {probe['name']}"
        raise JobInputError(
            f"the target needs about {need['need_gib']:.1f} GiB per actor (weights {need['weights_gib']:.1f} + KV "
            f"{need['kv_gib']:.1f} at {PROMPT_ALLOWANCE} prompt + max_new_tokens tokens, x{HEADROOM} headroom) but "
            f"an actor has {have:.1f} GiB ({share}); give each actor a whole GPU (--gpus-per-actor 1), a smaller "
            "dtype (--dtype bfloat16) or a smaller --max-new-tokens")
    return round(have, 2)


def describe_tree(cfg: DecodeConfig) -> str:
    if cfg.tree == "auto":
        return "calibrated on this machine while the first rows decode (cached per target, drafter, machine)"
    t = cfg.tree
    return f"fixed: top-k {t.top_k}, depth {t.depth}, {t.total_tokens} tokens"


def make_plan(spec: JobSpec, cfg: DecodeConfig, gpus: float, actor_cpus: float, rows: int, todo: int | None,
              drafter_why: str | None, probe: dict[str, Any] | None) -> dict[str, Any]:
    """The plan (also `_summary.json`'s `plan`); raises JobInputError for a target that cannot load or fit.
    `todo` None: the output exists and a run would resume into it (a dry run does not read it)."""
    try:
        layout = check_loadable(cfg.target, cfg.s3)
    except (TargetError, OSError, ValueError, KeyError) as e:  # a malformed config.json or header, too
        raise JobInputError(f"target: {e}") from e
    need = memory_need(layout, cfg.dtype, cfg.max_new_tokens)
    have = check_memory(need, gpus, probe)
    device = cfg.device
    if device.startswith("cuda") and probe and probe.get("cuda"):
        device = f"{device} ({probe['name']})"
    packing = f" ({round(1 / gpus)} actors per GPU)" if 0 < gpus < 1 else ""
    return {
        "target": cfg.target, "family": layout.model_type, "parameters": layout.parameters,
        "dtype": cfg.dtype, "device": device, "gpus_per_actor": gpus, "actors": spec.num_actors,
        "cpus_per_actor": round(actor_cpus, 2), "packing": packing.strip(" ()") or None,
        "memory_per_actor": {**need, "device_share_gib": have},
        "drafter": cfg.drafter, "drafter_why": drafter_why or "given",
        "tree": describe_tree(cfg), "input": spec.input, "rows": rows, "to_decode": todo, "output": spec.output,
    }


def params_text(n: int) -> str:
    """A parameter count as people say it: 7.62 B, 2.7 M."""
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def gib_text(gib: float) -> str:
    """A size in GiB, or in MiB below one GiB (toy targets)."""
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a few lines for the terminal."""
    mem = plan["memory_per_actor"]
    share = f" of {gib_text(mem['device_share_gib'])}" if mem.get("device_share_gib") else ""
    gpus = f"{plan['gpus_per_actor']:g} GPU per actor{' (' + plan['packing'] + ')' if plan['packing'] else ''}" \
        if plan["gpus_per_actor"] else "no GPU (CPU)"
    return "\n".join([
        "plan:",
        f"  target   {plan['target']} ({plan['family']}, {params_text(plan['parameters'])} parameters)",
        f"  decode   {plan['dtype']} on {plan['device']}; {plan['actors']} actor(s), {gpus}, "
        f"{plan['cpus_per_actor']:g} CPU each",
        f"  memory   ~{gib_text(mem['need_gib'])} per actor{share} (weights {gib_text(mem['weights_gib'])}, KV "
        f"{gib_text(mem['kv_gib'])})",
        f"  drafter  {plan['drafter']}: {plan['drafter_why']}",
        f"  tree     {plan['tree']}",
        f"  rows     {plan['rows']} from {plan['input']}, " + (
            f"{plan['to_decode']} to decode" if plan["to_decode"] is not None else
            "the output exists: a run decodes only the rows not in it yet"),
        f"  output   {plan['output']}",
    ])
