"""The one reading of a user's `--target` (`mmspec generate`, the batch jobs): toy world name, s3:// URI or local path."""

from __future__ import annotations


def resolve_target(target: str) -> str:
    """What `load_target` takes: a toy world name becomes its checkpoint directory (built on first use); anything
    else (an s3://bucket/prefix URI, a local or file:// path) passes through as the string it is. Never through
    `Path`, which would fold "s3://b/x" into the local path "s3:/b/x"."""
    from mmspec_ray.toy.model import TOY_SIZES

    if target in TOY_SIZES:
        from mmspec_ray.toy.build import build_toy

        return str(build_toy(target).target)
    return target


def toy_world(name: str):
    """The toy world `name` (built on first use): the default inputs of the batch jobs come from its splits."""
    from mmspec_ray.toy.build import build_toy

    return build_toy(name)
