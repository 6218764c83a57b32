#!/usr/bin/env python
"""Video captioning batch job: Kinetics annotation CSV + clip root (or parquet with video / video_uri) -> parquet.

    python jobs/caption_kinetics.py                      # the embedded toy world (toy-s, test split)
    python jobs/caption_kinetics.py --input s3://b/k400/val.csv --clip-root s3://b/k400/val/ \
        --output s3://b/captions/val/ --target s3://b/models/llava --num-actors 4 --gpus-per-actor 1
    ray job submit --working-dir . -- python jobs/caption_kinetics.py   # on a running cluster

Flags: python jobs/caption_kinetics.py --help. Re-running with the same --output resumes.
"""

import os
import sys

try:
    import mmspec_ray  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmspec_ray.batch.cli import entry

if __name__ == "__main__":
    entry("caption_kinetics")
