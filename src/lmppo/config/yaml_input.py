"""YAML from users, read strictly and with bounded work.

`yaml.safe_load` takes the last of two equal keys without a word (a repeated section such as `ppo:` twice
silently replaces the first one), and expands aliases without limit (a "billion laughs" document of a few lines
becomes gigabytes once anything walks or prints it). `load` here refuses both, before anything is built:

- a key given twice in one mapping (at any level) is an error naming the key and both lines; merge keys
  (`<<: *base`) still override as YAML specifies;
- the document, with every alias expanded, may hold at most `MAX_NODES` nodes, and aliases may not refer to
  themselves.
"""

from __future__ import annotations

from typing import IO, TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from yaml import Node  # PyYAML ships no types: Node is unchecked until types-PyYAML is installed

MAX_NODES = 100_000
"""Nodes of a document with its aliases expanded; a config has a few hundred."""


class YamlInputError(ValueError):
    """A YAML document that is ambiguous or too large once expanded; `line` is 1-based (or None)."""

    def __init__(self, message: str, line: Optional[int] = None):
        super().__init__(message)
        self.line = line


def _scalar_key(node: Node) -> Optional[tuple[str, str]]:
    import yaml

    if isinstance(node, yaml.ScalarNode):
        return (node.tag, node.value)
    return None


def _check_duplicates(node: Node) -> None:
    import yaml

    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            keys: dict[tuple[str, str], Node] = {}
            for key_node, value_node in n.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    stack.append(value_node)
                    continue
                key = _scalar_key(key_node)
                if key is not None:
                    if key in keys:
                        first = keys[key].start_mark.line + 1
                        again = key_node.start_mark.line + 1
                        shown = key[1] if len(key[1]) <= 80 else key[1][:80] + "..."
                        raise YamlInputError(
                            f"key `{shown}` is given twice in one mapping (line {first} and line {again}); keep one",
                            again,
                        )
                    keys[key] = key_node
                stack.append(key_node)
                stack.append(value_node)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def _expanded_size(root: Node, limit: int) -> int:
    """Nodes of the document with every alias expanded (shared nodes counted at each use), without expanding."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    # iterative post-order walk: (node, children pushed?)
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if expanded:
            on_path.discard(key)
            children = _children(node)
            total = 1 + sum(size[id(c)] for c in children)
            size[key] = min(total, limit + 1)
            continue
        if key in size:
            continue
        if key in on_path:
            raise YamlInputError(
                "an alias refers to the node that contains it (a recursive structure)", node.start_mark.line + 1
            )
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise YamlInputError(
                    "an alias refers to the node that contains it (a recursive structure)", child.start_mark.line + 1
                )
            if id(child) not in size:
                stack.append((child, False))
    return size[id(root)]


def _children(node: Node) -> list[Node]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def load(stream: str | IO[str]) -> object:
    """One YAML document from `stream` (text or a file), safely: only plain data, no duplicate keys, bounded size.
    Raises yaml.YAMLError for malformed YAML and YamlInputError for the refusals above."""
    import yaml

    loader = yaml.SafeLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicates(node)
        if _expanded_size(node, MAX_NODES) > MAX_NODES:
            raise YamlInputError(
                f"holds more than {MAX_NODES} values once its aliases (*name) are expanded; "
                "a config needs a few hundred (an alias bomb?)"
            )
        return loader.construct_document(node)
    except RecursionError:
        raise YamlInputError("is nested too deeply") from None
    finally:
        loader.dispose()
