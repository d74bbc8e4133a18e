"""The JSON schema of the daemon's settings, as the Helm chart's ``config`` values.

``charts/gpushare/values.schema.json`` holds this under ``properties.config`` (a test
checks that it is exactly what :func:`config_schema` gives), so Helm refuses an unknown
key, a bad value or a combination the daemon refuses at ``helm install`` instead of the
daemon crash-looping on it. Everything comes from the one description of the options in
:mod:`gpushare.config` (types, bounds, choices, patterns, :data:`~gpushare.config.RULES`);
tests/test_config_agreement.py feeds the same values to Helm and to the daemon.
``python -m gpushare.ops.chartschema`` prints it; ``--write`` puts it into the chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from gpushare.base.cli import Parser
from gpushare.config import OPTIONS, RULES, Rule, When, yaml_key

SCHEMA_FILE = Path("charts/gpushare/values.schema.json")


def _option_schema(option: dataclasses.Field[Any]) -> dict[str, Any]:
    kind: type = type(option.default)
    meta = option.metadata
    schema: dict[str, Any] = {"description": meta["help"]}
    if kind is bool:
        schema["type"] = "boolean"
    elif kind in (int, float):
        schema["type"] = "integer" if kind is int else "number"
        bounds = meta["bounds"]
        if bounds is not None:
            schema["minimum"], schema["maximum"] = bounds
    elif meta["choices"]:
        schema["type"] = "string"
        schema["enum"] = list(meta["choices"])
    else:
        text: dict[str, Any] = {"type": "string"}
        if meta["pattern"]:
            text["pattern"] = meta["pattern"]
        if meta["max_length"] is not None:
            text["maxLength"] = meta["max_length"]
        if meta["forbid"]:
            text["not"] = {"pattern": meta["forbid"]}
        if option.name == "ignored_xids":
            schema["oneOf"] = [
                text,
                {"type": "array", "items": {"type": "integer", "minimum": 0}},
            ]
        else:
            schema.update(text)
    return schema


def _condition(option: dataclasses.Field[Any], when: When) -> dict[str, Any]:
    if when.finds:
        return {"type": "string", "pattern": when.finds}
    return {"enum": list(when.values)}


def _rule_schema(rule: Rule) -> dict[str, Any]:
    """``not`` (every condition holds). A key left out of the values (``null`` in Helm
    removes it) means the daemon's default: it is required only where the default does
    not meet its condition."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, when in rule.when:
        option = next(o for o in OPTIONS if o.name == name)
        properties[yaml_key(name)] = _condition(option, when)
        if not when.holds(option.default):
            required.append(yaml_key(name))
    match: dict[str, Any] = {"properties": properties}
    if required:
        match["required"] = required
    return {"description": f"{yaml_key(rule.blame)}: {rule.why}", "not": match}


def config_schema() -> dict[str, Any]:
    """The schema of the chart's ``config`` mapping: every option, nothing else."""
    return {
        "type": "object",
        "description": "Every option of gpushare-device-plugin (its --config file)",
        "additionalProperties": False,
        "properties": {yaml_key(option.name): _option_schema(option) for option in OPTIONS},
        "allOf": [_rule_schema(rule) for rule in RULES],
    }


def chart_schema(current: dict[str, Any]) -> dict[str, Any]:
    """The chart's whole values schema with its ``config`` part regenerated."""
    schema = dict(current)
    schema["properties"] = dict(current["properties"], config=config_schema())
    return schema


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m gpushare.ops.chartschema", description=__doc__)
    parser.add_argument(
        "--write",
        metavar="FILE",
        nargs="?",
        const=str(SCHEMA_FILE),
        help=f"regenerate the config part of the chart's schema in FILE (default {SCHEMA_FILE})",
    )
    args: argparse.Namespace = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        schema = chart_schema(json.loads(path.read_text()))
        path.write_text(json.dumps(schema, indent=2) + "\n")
    else:
        print(json.dumps(config_schema(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
