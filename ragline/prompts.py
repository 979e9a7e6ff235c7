"""Loads the prompt templates of `prompts.toml` and renders them."""

from __future__ import annotations

import re
import tomllib
from functools import lru_cache
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("prompts.toml")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


@lru_cache
def templates() -> dict:
    return tomllib.loads(PROMPTS_FILE.read_text(encoding="utf-8"))


def language_of(text: str) -> str:
    """"zh" when the text contains CJK characters, else "en": enough to pick a canned reply."""
    return "zh" if _CJK.search(text) else "en"


def messages(step: str, *, opens_alike: bool = True, **fields: str) -> list[dict[str, str]]:
    """The step's system and user messages. A step that `opens_like` another has that step's system
    prompt, so that their prompts open alike (prompts.toml says why); with `opens_alike=False`, its own."""
    template = templates()[step]
    opener = template.get("opens_like") if opens_alike else None
    system = templates()[opener]["system"] if opener else template["system"]
    return [{"role": "system", "content": system.format(**fields)},
            {"role": "user", "content": template["user"].format(**fields)}]


def text(step: str, key: str) -> str:
    return templates()[step][key]


def no_context_answer(question: str) -> str:
    return templates()["no_context"][language_of(question)]


def no_documents_answer(question: str, collection: str) -> str:
    """What a turn says when the tenant has no documents in the collection (no model is called)."""
    return templates()["no_documents"][language_of(question)].format(collection=collection)


def no_documents_warning(collection: str) -> str:
    """The warning of a chat turn or a search on a collection in which the tenant has no documents."""
    return templates()["no_documents"]["warning"].format(collection=collection)


def not_covered_answer(question: str) -> str:
    """What a turn says when no passage is relevant enough (no model is called)."""
    return templates()["not_covered"][language_of(question)]


def no_answer(question: str) -> str:
    """What a turn says when the model's answer had no words of its own (it is not passed on as one)."""
    return templates()["no_answer"][language_of(question)]


def format_passages(passages: list) -> str:
    """Numbered passages (objects with filename, page and text) as the prompts cite them: [1], [2]…"""
    return "\n\n".join(f"[{i}] ({p.filename}, page {p.page}) {p.text}" for i, p in enumerate(passages, 1))


def format_passage_heads(passages: list) -> str:
    """The numbers and sources of the passages without their text (when a summary stands in for it)."""
    return "\n".join(f"[{i}] ({p.filename}, page {p.page})" for i, p in enumerate(passages, 1))


def agent_tools() -> list[dict]:
    """The agent's tool allowlist as OpenAI `tools`."""
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["parameters"]}}
            for t in templates()["agent"]["tools"]]
