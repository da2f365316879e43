"""YAML as configs are read: PyYAML's safe loader, with two of its YAML 1.1 surprises fixed.

- The same key twice in one mapping is an error (PyYAML keeps the last silently, so a
  setting written twice loses the first without a word).
- `1e-3`, `5e4` and `1E+6` are numbers, as in YAML 1.2 and Python (PyYAML's 1.1 resolver
  wants a dot, `1.0e-3`, and reads `1e-3` as the string "1e-3").
"""

from __future__ import annotations

import re
from typing import IO, Any

import yaml

__all__ = ["ConfigLoader", "load_yaml"]


class ConfigLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses duplicate keys and reads `1e-3` as a float."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"found the key {key!r} twice (first on line {first.line + 1}); a setting "
                    "is given once per mapping", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats (PyYAML's own pattern, with the dot made optional before an exponent).
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def load_yaml(stream: str | IO[str]) -> Any:
    """The YAML document in `stream` (`yaml.YAMLError` on a mistake, with its position)."""
    return yaml.load(stream, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)
