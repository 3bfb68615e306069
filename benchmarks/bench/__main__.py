"""``python -m benchmarks.bench [args]``: run the benchmark (:func:`benchmarks.bench.driver.main`)."""

from __future__ import annotations

import sys

from .driver import main

if __name__ == "__main__":
    sys.exit(main())
