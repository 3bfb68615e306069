"""The benchmark (``python -m benchmarks.bench``) and its scripts: outside the installed package."""
