"""The gateway config's YAML reader: PyYAML's safe loader, refusing a key given twice in one mapping."""

from __future__ import annotations

import yaml


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML's last-one-wins would silently drop the
    first, e.g. one of two `usageLimit:` blocks)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` keys may be overridden by explicit ones
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the key {key!r} twice (first on line {first.start_mark.line + 1}); keep one",
                        key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """`text` parsed as YAML with safe types only; yaml.YAMLError (with line numbers) on a key given twice."""
    return yaml.load(text, Loader=_StrictLoader)
