#!/usr/bin/env python
"""Benchmark: Ray Data pipeline (1 decoder actor) vs direct `SpecDecoder.decode` on the same toy-world rows.

    python jobs/bench_batch.py                     # writes out/bench_batch/bench_batch.{json,md}
    python jobs/bench_batch.py --jobs caption --repeats 3 --max-new-tokens 128

Not a test: a script that measures and writes its figures (see docs/batch.md).
"""

import os
import sys

try:
    import mmspec_ray  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmspec_ray.bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
