"""Thin wrapper: ``python benchmarks/run_bench.py [args]`` == ``python -m benchmarks.bench [args]``.

The full README run: ``python benchmarks/run_bench.py --sweep 0.2,0.8,3.2 --plot --update-readme``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench import main

if __name__ == "__main__":
    sys.exit(main())
