"""Ray Serve application builder, for `serve run`, `serve deploy` and KubeRay's `RayService`:

    serve run specdecode.cluster.serve_app:app_builder model=smollm2-135m-instruct dtype=fp32 replicas=2

or, in a Serve config file, `import_path: specdecode.cluster.serve_app:app_builder` with the options of
`ClusterConfig` under `args`. Values given as strings (from the `serve run` command line) are converted
to the option's type.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from specdecode.cluster.config import ClusterConfig


def _convert(name: str, value: Any, annotation: str) -> Any:
    if not isinstance(value, str) or annotation.startswith("str"):
        return value
    if value.lower() in ("none", "null", ""):
        return None
    if annotation.startswith("dict"):
        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError(f"{name} must be a JSON object, got {value!r}")
        return parsed
    if annotation.startswith("int"):
        return int(value)
    if annotation.startswith("float"):
        return float(value)
    return value


def config_from_dict(args: dict[str, Any]) -> ClusterConfig:
    fields = {f.name: str(f.type) for f in dataclasses.fields(ClusterConfig)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ValueError(f"unknown cluster options {unknown}; known: {sorted(fields)}")
    return ClusterConfig(**{k: _convert(k, v, fields[k]) for k, v in args.items()})


def app_builder(args: dict[str, Any]) -> Any:
    from specdecode.cluster.deployment import build_application

    return build_application(config_from_dict(dict(args)))
