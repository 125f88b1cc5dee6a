"""Where benchmarks leave their numbers: one JSON file each, under ``loadtests/results/`` by
default."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, data: Any) -> str:
    """Write ``data`` as indented JSON to ``path``, creating its folder; returns the absolute
    path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path
