#!/usr/bin/env python
"""Train a drafter for any target from a parquet of requests: Ray Data data generation (the target answers, its
features go to shards on disk or S3), then training (single process, or Ray Train with --num-workers N), then the
held-out τ; the drafter lands at --out and loads with `--drafter OUT`.

    python jobs/train_drafter.py --method eagle2 --target s3://b/models/llava --data s3://b/requests/ \
        --out s3://b/drafters/llava-eagle2 --num-workers 4 --use-gpu --datagen-actors 4
    ray job submit --working-dir . -- python jobs/train_drafter.py --target ... --data ... --out ...

Flags: python jobs/train_drafter.py --help. Re-running with the same --out (or --work) resumes. docs/training.md.
"""

import os
import sys

try:
    import mmspec_ray  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmspec_ray.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
