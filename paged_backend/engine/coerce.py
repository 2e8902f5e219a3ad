"""Typed values from JSON that may carry numbers and booleans as strings ("0.5", "16", "true").

Triton's request parameters and vLLM-style `model.json` files often hold every value as a string; these
helpers turn them into the Python type a field needs, or raise an `InvalidParameter` (a ValueError) naming
the field.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional

from paged_backend.errors import InvalidParameter


def _error(name: str, message: str) -> InvalidParameter:
    return InvalidParameter(message, param=name.split("[")[0])

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def to_bool(name: str, value: Any) -> bool:
    """true/false given as a JSON boolean, 0/1 or a string such as "true"."""
    if isinstance(value, bool):
        return value
    if hasattr(value, "dtype") and value.dtype == bool:  # numpy scalar
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _error(name, f"{name} must be a boolean (true or false), got {value!r}")


def to_int(name: str, value: Any) -> int:
    """An integer given as a JSON number without fraction or a string such as "16"."""
    if isinstance(value, bool):
        raise _error(name, f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = math.nan
            if math.isfinite(number) and number.is_integer():
                return int(number)
    raise _error(name, f"{name} must be an integer, got {value!r}")


def to_float(name: str, value: Any) -> float:
    """A finite number given as a JSON number or a string such as "0.7"."""
    if isinstance(value, bool):
        raise _error(name, f"{name} must be a number, got {value!r}")
    number: Optional[float] = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise _error(name, f"{name} must be a finite number, got {value!r}")
    return number


def to_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _error(name, f"{name} must be a string, got {value!r}")
    return value


def _maybe_json(value: Any) -> Any:
    """A list or object given as a JSON string ('["a", "b"]') is unpacked; anything else is returned as is."""
    if isinstance(value, str) and value.strip().startswith(("[", "{")):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):  # not JSON (or nested absurdly deep): the string itself
            return value
    return value


def to_str_list(name: str, value: Any) -> List[str]:
    """A string or a list of strings (also a JSON list inside a string)."""
    value = _maybe_json(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise _error(name, f"{name} must be a string or a list of strings, got {value!r}")


def to_int_list(name: str, value: Any) -> List[int]:
    """A list of integers (also a JSON list inside a string, or one integer)."""
    value = _maybe_json(value)
    if not isinstance(value, list):
        value = [value]
    return [to_int(f"{name}[{i}]", v) for i, v in enumerate(value)]


def to_float_map(name: str, value: Any) -> Dict[int, float]:
    """A JSON object of token id -> number (keys may be strings, as JSON requires; also inside a string)."""
    value = _maybe_json(value)
    if not isinstance(value, dict):
        raise _error(name, f"{name} must be an object mapping token ids to numbers, got {value!r}")
    return {to_int(f"{name}[{key!r}]", key): to_float(f"{name}[{key!r}]", v) for key, v in value.items()}
