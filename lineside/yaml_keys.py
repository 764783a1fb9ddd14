"""YAML that refuses a key written twice in one mapping: YAML (and PyYAML) keep the last without a word, so an
operator's file would be misread silently (fleet files, SLO policies)."""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(Exception):
    """``key`` written at lines ``first`` and ``second`` (1-based) of one mapping."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"{key!r} (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader raising DuplicateKey at a repeated key. Keys brought in by a ``<<`` merge may be overridden, as
    YAML means them to be."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for k, _ in node.value:
            if k.tag == "tag:yaml.org,2002:merge" or not isinstance(k, yaml.ScalarNode):
                continue
            key = self.construct_object(k, deep=True)
            line = k.start_mark.line + 1
            if key in seen:
                raise DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_unique(text: str) -> Any:
    """``yaml.safe_load`` that raises DuplicateKey at a key written twice."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
