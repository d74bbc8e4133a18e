"""A YAML loader that refuses duplicate mapping keys (issue 32.17).

PyYAML, like kubectl, keeps the last of two equal keys silently; a strict parser
(and the reader of the manifest) sees two values. Every rendered template and
every manifest in the suite is read with this loader.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

#: libyaml's parser where PyYAML was built with it (the wheels are): the same documents
#: and constructors, parsed about ten times faster than by the pure-Python one (the deploy
#: tests read thousands of rendered templates).
_SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class StrictLoader(_SafeLoader):
    """``yaml.SafeLoader`` with duplicate keys an error, where the second one is."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        self.flatten_mapping(node)
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if key in seen:
                raise ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, StrictLoader.construct_mapping
)


def load(text: str) -> Any:
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader


def load_all(text: str) -> list[Any]:
    return list(yaml.load_all(text, Loader=StrictLoader))  # a SafeLoader
