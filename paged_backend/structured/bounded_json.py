"""JSON read from requests with a bound on nesting, so a hostile document is a clear `ValueError`.

Python's json module recurses per nesting level: a document nested a few thousand levels deep raises
`RecursionError` (not a `ValueError`), and code that walks the parsed value recursively (JSON-schema checks,
grammar compilers) can fail the same way further on. `loads` turns both into a `ValueError` naming the
document; `check_depth` bounds a value that was parsed elsewhere. Neither recurses.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 128  # nesting levels (objects and arrays) of a JSON document a request may carry


def depth_of(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply `value` nests dicts and lists (a scalar is 0), counting no further than `limit` + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest


def check_depth(value: Any, what: str, limit: int = MAX_DEPTH) -> Any:
    """`value` itself, or a ValueError when it nests dicts and lists more than `limit` levels deep."""
    if depth_of(value, limit) > limit:
        raise ValueError(f"{what} is nested more than {limit} levels deep")
    return value


def loads(text: Any, what: str, limit: int = MAX_DEPTH) -> Any:
    """The JSON value in `text` (str or bytes); a ValueError naming `what` when it is not valid JSON or is
    nested more than `limit` levels deep."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested more than {limit} levels deep") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    return check_depth(value, what, limit)
