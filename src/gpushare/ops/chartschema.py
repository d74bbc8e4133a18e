"""The JSON schema of the daemon's settings, as the Helm chart's ``config`` values.

``charts/gpushare/values.schema.json`` holds this under ``properties.config`` (a test
checks that it is exactly what :func:`config_schema` gives), so Helm refuses an unknown
key or a bad value at ``helm install`` instead of the daemon crash-looping on it.
``python -m gpushare.ops.chartschema`` prints it.
"""

from __future__ import annotations

import json
from typing import Any

from gpushare.config import DNS_SUBDOMAIN, OPTIONS, XIDS_PATTERN, yaml_key


def _option_schema(option: Any) -> dict[str, Any]:
    kind = type(option.default)
    schema: dict[str, Any] = {"description": option.metadata["help"]}
    if kind is bool:
        schema["type"] = "boolean"
    elif kind in (int, float):
        schema["type"] = "integer" if kind is int else "number"
        bounds = option.metadata["bounds"]
        if bounds is not None:
            schema["minimum"], schema["maximum"] = bounds
    elif option.metadata["choices"]:
        schema["enum"] = list(option.metadata["choices"])
    elif option.name == "ignored_xids":
        schema["oneOf"] = [
            {"type": "string", "pattern": XIDS_PATTERN},
            {"type": "array", "items": {"type": "integer", "minimum": 0}},
        ]
    else:
        schema["type"] = "string"
        if option.name == "resource_prefix":
            schema["pattern"] = DNS_SUBDOMAIN
            schema["maxLength"] = 253
        elif option.name == "dra_driver":
            schema["pattern"] = DNS_SUBDOMAIN
            schema["maxLength"] = 63
        elif option.name == "kubelet_dir":
            schema["minLength"] = 1
    return schema


def config_schema() -> dict[str, Any]:
    """The schema of the chart's ``config`` mapping: every option, nothing else."""
    return {
        "type": "object",
        "description": "Every option of gpushare-device-plugin (its --config file)",
        "additionalProperties": False,
        "properties": {yaml_key(option.name): _option_schema(option) for option in OPTIONS},
    }


if __name__ == "__main__":
    print(json.dumps(config_schema(), indent=2))
