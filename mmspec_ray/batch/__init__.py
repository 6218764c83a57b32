"""Ray Data batch inference: parquet (local or s3://) -> media decoding -> SpecDecoder actor pool -> parquet.

Entry points: `run_job(JobSpec)`, the per-row `SpecDecoder.decode(row)`, and `jobs/*.py` on the command line.
"""

from mmspec_ray.batch.decoder import SpecDecoder
from mmspec_ray.batch.jobspec import DEFAULT_DRAFTER, DecodeConfig, JobSpec, MediaSpec

__all__ = ["DEFAULT_DRAFTER", "DecodeConfig", "JobSpec", "MediaSpec", "SpecDecoder", "run_job"]


def __getattr__(name: str):
    if name == "run_job":  # keeps `import mmspec_ray.batch` light for Serve (no Ray Data pipeline import)
        from mmspec_ray.batch.pipeline import run_job

        return run_job
    raise AttributeError(name)
