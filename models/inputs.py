"""What a person sends (API bodies, Updates and Signals from the Web UI or CLI) is validated strictly:
no unknown fields, no coercion ("1" is not a number, 0 is not false), so the API refuses exactly what
its OpenAPI schema refuses."""

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict

STRICT_INPUT = ConfigDict(strict=True, extra="forbid")

# A text a person types must say something: at least one character that is neither white space nor an invisible
# zero-width one (ZWSP, ZWNJ, ZWJ, word joiner, BOM: a message of those reached the model as an empty question). A
# JSON Schema pattern matches anywhere in the string, as pydantic's does, so the OpenAPI says the same.
NOT_BLANK = r"[^\s\u200b-\u200d\u2060\ufeff]"


def _integral(value: Any) -> Any:
    """JSON Schema's `integer` includes 3.0: take it as 3 (3.5 and "3" stay refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
