"""Prompt files: one prompt per line, or JSON lines; ``-`` reads standard input. Torch-free.

A text file holds one prompt per non-blank line, with ``\\n``, ``\\t`` and ``\\\\`` standing for a
newline, a tab and a backslash. A ``.jsonl`` file (or any file whose first non-blank line starts with
``{`` or ``"``) holds one JSON value per line: a string (the prompt), or an object with ``"prompt"``
(text) or ``"messages"`` (a conversation, for chat mode) and optionally an ``"id"`` that is echoed in
the results.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from expertcache.errors import ExpertcacheError

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a file: its text or messages, its id (the file's, or its line number), its line."""

    prompt: str | list
    id: object
    line: int


def read_text(path: str | Path, what: str = "prompt") -> str:
    """A whole file (``-``: standard input) as text."""
    where = "standard input" if str(path) == "-" else path
    if str(path) == "-" and sys.stdin is None:  # started with its standard input closed (<&-)
        raise ExpertcacheError(f"standard input is closed: cannot read the {what} from -; give a file")
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        else:
            data = Path(path).read_bytes()
        return data.decode("utf-8-sig")  # an editor's byte-order mark is no part of the text
    except IsADirectoryError:
        raise ExpertcacheError(f"{where}: cannot read the {what}: it is a folder, not a file") from None
    except OSError as exc:
        raise ExpertcacheError(f"{where}: cannot read the {what} ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ExpertcacheError(
            f"{where}: cannot read the {what}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
            f"position {exc.start})"
        ) from None


def read_prompt_items(path: str | Path) -> list[PromptItem]:
    """The prompts of a file (``-``: standard input), plain lines or JSON lines."""
    lines = read_text(path, "prompts").splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise ExpertcacheError(f"{path}: no prompts (one per line, or one JSON value per line)")
    as_json = str(path).endswith(".jsonl") or numbered[0][1].lstrip().startswith("{")
    items = [_json_item(path, n, line) if as_json else _text_item(n, line) for n, line in numbered]
    return items


def read_prompts(path: str | Path) -> list[str]:
    """Plain prompts only (one per line, or JSON lines of text): for tools that take no conversations."""
    out = []
    for item in read_prompt_items(path):
        if not isinstance(item.prompt, str):
            raise ExpertcacheError(f"{path}:{item.line}: a conversation, but plain prompts are wanted here")
        out.append(item.prompt)
    return out


def _text_item(number: int, line: str) -> PromptItem:
    return PromptItem(re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], line), number, number)


def _json_item(path: str | Path, number: int, line: str) -> PromptItem:
    where = f"{path}:{number}"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ExpertcacheError(f"{where}: not JSON ({exc.msg}); JSON lines hold one value a line") from None
    if isinstance(value, str):
        return PromptItem(value, number, number)
    if not isinstance(value, dict) or ("prompt" in value) == ("messages" in value):
        raise ExpertcacheError(f'{where}: want a string, or an object with "prompt" or "messages"')
    unknown = set(value) - {"prompt", "messages", "id"}
    if unknown:
        raise ExpertcacheError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (prompt, messages, id)")
    prompt = value.get("prompt", value.get("messages"))
    if "prompt" in value and not isinstance(prompt, str):
        raise ExpertcacheError(f'{where}: "prompt" must be text')
    if "messages" in value and not isinstance(prompt, list):
        raise ExpertcacheError(f'{where}: "messages" must be a list of {{"role", "content"}} objects')
    return PromptItem(prompt, value.get("id", number), number)
