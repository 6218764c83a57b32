"""Ray Serve online endpoint: OpenAI-compatible chat completions on the batch pipeline's `SpecDecoder`.

`mmspec_ray.serve.app:build_app` is the `import_path` of the configs in deployments/ (see docs/serve.md).
"""
