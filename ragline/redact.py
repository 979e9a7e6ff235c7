"""Masking of sensitive data (RAGLINE_REDACT_PII): e-mail addresses, ID numbers and phone numbers.

Applied to every text sent to a chat model that is not local (ragline/llm.py) and to every log line
(ragline/logs.py). Phones keep their first three and last four digits (`138****5678`); e-mail
addresses and ID numbers are replaced whole (`[email]`, `[id]`).
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import unquote

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
# Chinese resident ID (18: 17 digits + digit/X; 15 digits, old), US SSN.
ID_NUMBER = re.compile(r"(?<![\dA-Za-z])(?:\d{17}[\dXx]|\d{15}|\d{3}-\d{2}-\d{4})(?![\dA-Za-z])")
# Mainland mobiles (11 digits, 1[3-9]...), and international/grouped numbers: an optional +country
# code, then 3+ groups of digits separated by spaces, dots, dashes or parentheses, 9-15 digits in all.
PHONE = re.compile(r"(?<![\w+])(?:\+?86[\s-]?)?1[3-9]\d(?:[\s-]?\d{4}){2}(?!\d)"
                   r"|(?<![\w+])\+?\(?\d{1,4}\)?(?:[\s.-]?\(?\d{2,5}\)?){2,5}(?!\d)")


def _mask_phone(match: re.Match[str]) -> str:
    text = match.group(0)
    digits = re.sub(r"\D", "", text)
    if not 9 <= len(digits) <= 15:
        return text
    return digits[:3] + "*" * (len(digits) - 7) + digits[-4:]


def redact(text: str) -> str:
    text = EMAIL.sub("[email]", text)
    text = ID_NUMBER.sub("[id]", text)
    return PHONE.sub(_mask_phone, text)


def redact_messages(messages: list[dict]) -> list[dict]:
    """Chat messages with every string content masked (tool definitions are left alone)."""
    out = []
    for m in messages:
        content = m.get("content")
        out.append({**m, "content": redact(content)} if isinstance(content, str) else m)
    return out


def redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v) for v in value)
    return value


def structlog_processor(_logger, _method, event_dict: dict) -> dict:
    return {k: redact_value(v) for k, v in event_dict.items()}


class RedactingFilter(logging.Filter):
    """Masks a standard-library log record's final message (structlog's lines pass through here too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if "%" in masked and (decoded := unquote(masked)) != (unmasked := redact(decoded)):
            masked = unmasked  # a URL-encoded path (uvicorn's access line): jane.doe%40example.com
        if masked != message:
            record.msg, record.args = masked, None
        return True
