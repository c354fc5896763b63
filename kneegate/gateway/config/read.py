"""Reading a config file: its top-level YAML mapping, or `ConfigError` saying why not.

A file is refused before validation when it cannot be a config: unreadable, not UTF-8,
over `MAX_CONFIG_BYTES`, empty or only comments, broken YAML, nested deeper than
`MAX_DEPTH` or expanding (through aliases) past `MAX_NODES` values. Secrets are never
echoed: YAML errors give the problem, line and column but not the source line. Validation
of what is read is `gateway.config`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kneegate.gateway.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_NODES", "read_config"]


# libyaml's loader where PyYAML was built with it: ~10x faster (a reload runs on the event
# loop); errors carry the same problem and line, and it caps nesting at 1000 itself.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_CONFIG_BYTES = 1 << 20  # far above any real config (about 25,000 API keys)
MAX_DEPTH = 32  # a config nests ~5 deep; PyYAML's loader recurses once per level
MAX_NODES = 200_000  # values after alias expansion; a "billion laughs" file has 10**9


def read_config(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping, or ConfigError saying why it cannot be a config."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(str(p), "", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(str(p), "", f"larger than {MAX_CONFIG_BYTES} bytes: not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(str(p), "", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} "
                                      f"at line {line}); save the file as UTF-8") from None
    data = _parse_yaml(text, str(p))
    if data is None:
        raise ConfigError(str(p), "", "the config is empty (nothing but blanks or comments); "
                                      "write {} to mean every default")
    if not isinstance(data, dict):
        raise ConfigError(str(p), "", f"the top level must be a mapping, got {type(data).__name__}")
    for key in ("admin_token", "admin_token_file"):
        if key in data and data[key] is None and _written_empty(text, key):
            # `admin_token:` with nothing after it is also how a file cut short ends
            raise ConfigError(str(p), key, f"no value; give the token, or write "
                                           f"`{key}: null` to run without one")
    return data


def _parse_yaml(text: str, source: str) -> Any:
    try:
        _check_shape(text, source)
        return yaml.load(text, Loader=_LOADER)  # a safe loader: plain data only
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {_yaml_problem(exc)}") from None
    except yaml.reader.ReaderError as exc:  # a control character, e.g. a NUL
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        line = text[:exc.position].count("\n") + 1
        raise ConfigError(source, "", f"not valid YAML: character #x{code:04x} is not allowed "
                                      f"(line {line})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {exc}") from None
    except ValueError as exc:  # Python refuses integers of over 4300 digits
        reason = str(exc).split(";")[0]
        raise ConfigError(source, "", f"a value cannot be converted: {reason}") from None


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    # PyYAML's own message quotes the source line around the error, which may hold the
    # admin token or an API key: give the problem and where it is, never the snippet.
    text = exc.problem or "syntax error"
    if exc.problem_mark is not None:
        text += f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
    if exc.context:
        text += f" ({exc.context}"
        if exc.context_mark is not None:
            text += f" from line {exc.context_mark.line + 1}"
        text += ")"
    return text


def _check_shape(text: str, source: str) -> None:
    """Refuse YAML that costs more to load than any config needs, before loading it.

    Nesting deeper than MAX_DEPTH (the loader recurses per level: 10,000 `[` raise a
    RecursionError) and more than MAX_NODES values once aliases are expanded (the loader
    shares aliased nodes, but validation walks every copy: a ten-line "billion laughs" file
    never finishes). Walks the parser's events, which recurses on nothing and builds nothing.
    """
    sizes: dict[str, int] = {}  # anchor -> values it expands to
    anchors: list[str | None] = []  # per open collection: its anchor,
    counts: list[int] = []  # and the values in it so far
    total = 0
    for ev in yaml.parse(text, Loader=_LOADER):
        if isinstance(ev, yaml.CollectionEndEvent):
            anchor, n = anchors.pop(), counts.pop()
            if anchor is not None:
                sizes[anchor] = n
            if counts:
                counts[-1] += n
            continue
        if isinstance(ev, yaml.AliasEvent):
            n = sizes.get(ev.anchor or "", 1)  # an alias of an open collection: 1
        elif isinstance(ev, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            n = 1
        else:
            continue
        total += n
        line = ev.start_mark.line + 1 if ev.start_mark is not None else 0
        if total > MAX_NODES:
            raise ConfigError(source, "", f"expands to more than {MAX_NODES} values through "
                                          f"aliases (line {line})")
        if isinstance(ev, yaml.CollectionStartEvent):
            if len(counts) >= MAX_DEPTH:
                raise ConfigError(source, "", f"nested deeper than {MAX_DEPTH} levels "
                                              f"(line {line})")
            anchors.append(ev.anchor)
            counts.append(1)
            continue
        if isinstance(ev, yaml.ScalarEvent) and ev.anchor is not None:
            sizes[ev.anchor] = 1
        if counts:
            counts[-1] += n


def _written_empty(text: str, name: str) -> bool:
    """Whether the top-level key `name` is written with no value at all (not `null`)."""
    root = yaml.compose(text, Loader=_LOADER)
    empty = False
    for key, value in root.value if isinstance(root, yaml.MappingNode) else ():
        if isinstance(key, yaml.ScalarNode) and key.value == name:  # the last one wins
            empty = isinstance(value, yaml.ScalarNode) and value.value == "" and not value.style
    return empty

