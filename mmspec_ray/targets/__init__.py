"""HF VLM target adapters: one file per family, a registry, and `load_target`."""

from mmspec_ray.targets.base import InvalidRequest, PromptTooLong, Request, TargetError, TargetOutput, VLMTarget
from mmspec_ray.targets.registry import families, load_target, wrap

__all__ = ["InvalidRequest", "PromptTooLong", "Request", "TargetError", "TargetOutput", "VLMTarget", "families",
           "load_target", "wrap"]
