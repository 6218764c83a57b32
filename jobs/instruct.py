#!/usr/bin/env python
"""Image + instruction batch job: parquet rows with `prompt` and `image` / `image_uri` -> parquet with answers.

    python jobs/instruct.py                              # the embedded toy world (toy-s, test split images)
    python jobs/instruct.py --input s3://b/llava-instruct/ --output s3://b/answers/ --target /models/llava \
        --num-actors 2 --gpus-per-actor 1
    ray job submit --working-dir . -- python jobs/instruct.py

Flags: python jobs/instruct.py --help. Re-running with the same --output resumes.
"""

import os
import sys

try:
    import mmspec_ray  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmspec_ray.batch.cli import entry

if __name__ == "__main__":
    entry("instruct")
