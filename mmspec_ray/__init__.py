"""mmspec-ray: lossless tree speculative decoding for vision-language models, on Ray."""

__version__ = "0.1.0"

__all__ = ["ProcessorConfig", "build_processor"]


def __getattr__(name: str):
    """`from mmspec_ray import build_processor, ProcessorConfig` without importing Ray Data on `import mmspec_ray`."""
    if name in __all__:
        from mmspec_ray.batch import processor

        return getattr(processor, name)
    raise AttributeError(f"module 'mmspec_ray' has no attribute {name!r}")
