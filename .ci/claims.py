"""Print what pyproject.toml claims, for .ci/run's torch-range legs: the oldest Python, the newest
Python (its classifiers) and the oldest torch, e.g. ``3.11 3.13 2.10``."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
oldest_python = re.fullmatch(r">=\s*(3\.\d+)", project["requires-python"])
pythons = [
    c.rsplit("::", 1)[1].strip()
    for c in project["classifiers"]
    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
]
torch = [m for d in project["dependencies"] if (m := re.fullmatch(r"torch>=(\d+\.\d+)", d))]
if oldest_python is None or not pythons or len(torch) != 1:
    sys.exit("pyproject.toml: expected requires-python '>=3.N', Python 3.N classifiers and one 'torch>=X.Y'")
newest_python = max(pythons, key=lambda v: tuple(map(int, v.split("."))))
if min(pythons, key=lambda v: tuple(map(int, v.split(".")))) != oldest_python.group(1):
    sys.exit(
        f"pyproject.toml: requires-python {project['requires-python']} but the oldest classifier is not it"
    )
print(oldest_python.group(1), newest_python, torch[0].group(1))
