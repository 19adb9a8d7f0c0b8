"""Reading a plan file or vTrain config into its top-level mapping, safely whatever the bytes.

Every way a file can be wrong ends in one :class:`ConfigError` naming the file, quickly: the file
is read up to :data:`~vtrain_plugin.specs.limits.FILE_BYTES` (a larger one, or a device that never
ends, is refused), decoded as UTF-8, parsed as JSON or (``.yaml``/``.yml``) YAML, and refused when
it nests deeper than :data:`~vtrain_plugin.specs.limits.NESTING_DEPTH` or holds more than
:data:`~vtrain_plugin.specs.limits.FILE_VALUES` values. YAML is read by PyYAML's safe loader, which
builds no Python objects of its own, with the depth and the values counted as the document is
composed, each alias counting the values of its anchor: a YAML alias bomb (a few lines whose
aliases expand to billions of values) is refused before it is built.

YAML is read with YAML 1.2's float syntax (as JSON has it): ``270e9`` and ``2.7e11`` are numbers,
where PyYAML's YAML 1.1 rules would read them as strings (it wants a dot and a signed exponent).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from vtrain_plugin.core.checks import show
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.limits import FILE_BYTES, FILE_VALUES, NESTING_DEPTH

YAML_SUFFIXES = (".yaml", ".yml")


def read_mapping(path: Path) -> Mapping[str, Any]:
    """The top-level mapping of a JSON or YAML (``.yaml``/``.yml``) file; errors name the file."""
    path = Path(path)
    try:
        return parse_mapping(_read_bytes(path), yaml_syntax=path.suffix.lower() in YAML_SUFFIXES)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def is_bridge_config(data: Mapping[str, Any]) -> bool:
    """Whether a file's mapping is a ConfigContainer: ``to_yaml()``'s ``_target_``, or a ``train``
    section (a plan file's is ``training``)."""
    target = data.get("_target_")
    return (isinstance(target, str) and target.endswith("ConfigContainer")) or "train" in data


def parse_mapping(data: bytes, *, yaml_syntax: bool) -> Mapping[str, Any]:
    """The top-level mapping of a file's bytes (see the module doc); errors do not name the file."""
    if len(data) > FILE_BYTES.maximum:
        raise ConfigError(f"more than {FILE_BYTES.maximum:,} bytes; plan files are a few hundred")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}") from None
    parsed = _parse_yaml(text) if yaml_syntax else _parse_json(text)
    if not isinstance(parsed, Mapping):
        raise ConfigError(f"the top level must be a mapping, got {type(parsed).__name__}")
    return parsed


def _read_bytes(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(FILE_BYTES.maximum + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}") from None


def _parse_json(text: str) -> Any:
    try:
        data = json.loads(text, parse_int=_integer, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _too_deep() from None
    _check_json_shape(data)
    return data


def _integer(text: str) -> int:
    """``int(text)`` of a JSON integer (see :func:`_check_digits`)."""
    return int(_check_digits(text))


def _check_digits(text: str) -> str:
    """``text``, unless it has more digits than Python converts to an integer (4,300): a ConfigError."""
    digits = len(text.lstrip("+-"))
    if digits > sys.get_int_max_str_digits():
        raise ConfigError(f"an integer of {digits:,} digits; numbers have at most {sys.get_int_max_str_digits():,}")
    return text


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a key given twice is an error, not the last value silently kept."""
    data = dict(pairs)
    if len(data) < len(pairs):
        keys = [key for key, _ in pairs]
        raise ConfigError(f"duplicate key {show(next(k for k in keys if keys.count(k) > 1))}")
    return data


def _check_json_shape(data: Any) -> None:
    """Depth (of nested objects and arrays) and number of values of parsed JSON, walked without recursion."""
    stack = [(data, 0)]
    values = 0
    while stack:
        value, depth = stack.pop()
        values += 1
        if values > FILE_VALUES.maximum:
            raise _too_many_values()
        if isinstance(value, (dict, list)):
            if depth + 1 > NESTING_DEPTH.maximum:
                raise _too_deep()
            stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))


def _parse_yaml(text: str) -> Any:
    loader = None
    try:
        loader = _Loader(text)  # checks the characters
        return loader.get_single_data()
    except ConfigError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(f"malformed YAML: {_one_line(exc.problem or exc.context or 'syntax error')}{where}") from None
    except yaml.reader.ReaderError as exc:
        raise ConfigError(f"malformed YAML: {exc.reason} (position {exc.position})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML: {_one_line(exc)}") from None
    except ValueError as exc:  # a date such as 2024-13-45
        raise ConfigError(f"malformed YAML: {_one_line(exc)}") from None
    finally:
        if loader is not None:
            loader.dispose()


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load`` that reads YAML 1.2 floats (``270e9``) and counts depth and values as it
    composes the document (see the module doc)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0  # collections around the node being composed, itself included
        self._deepest = 0  # the deepest collection reached inside it so far
        self._values = 0
        self._anchored: dict[str, tuple[int, int]] = {}  # anchor -> (values, collection levels) of its node

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.anchors and event.anchor not in self._anchored:
                raise ConfigError(f"YAML alias *{event.anchor} refers to a node that contains it")
            values, levels = self._anchored.get(event.anchor, (1, 0))  # undefined: the composer says so
            self._count(values, self._depth + levels)
            return super().compose_node(parent, index)
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        self._depth += collection
        self._count(1, self._depth)
        values_before, deepest_before = self._values, self._deepest
        self._deepest = self._depth
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= collection
        if event.anchor is not None:
            self._anchored[event.anchor] = (self._values - values_before + 1, self._deepest - self._depth)
        self._deepest = max(self._deepest, deepest_before)
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        _check_digits(node.value.replace("_", ""))
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """A mapping; a key given twice is an error, not the last value silently kept (keys merged
        in with ``<<`` may be overridden, as YAML intends)."""
        seen: list[Any] = []
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(f"duplicate key {show(key)} at line {mark.line + 1} column {mark.column + 1}")
            seen.append(key)
        return super().construct_mapping(node, deep=deep)

    def _count(self, values: int, depth: int) -> None:
        self._values += values
        self._deepest = max(self._deepest, depth)
        if self._values > FILE_VALUES.maximum:
            raise _too_many_values()
        if depth > NESTING_DEPTH.maximum:
            raise _too_deep()


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _too_deep() -> ConfigError:
    return ConfigError(f"nested more than {NESTING_DEPTH.maximum} levels deep; plan files nest two")


def _too_many_values() -> ConfigError:
    return ConfigError(f"more than {FILE_VALUES.maximum:,} values (YAML aliases expanded); plan files hold some 50")


def _one_line(exc: Any) -> str:
    return " ".join(str(exc).split())
