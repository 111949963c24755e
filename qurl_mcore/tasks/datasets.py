"""Prompt sets: one `Example` per prompt, from JSONL or Parquet files in GSM8K/MATH style."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

#: GSM8K puts the final answer after "#### "; the reasoning before it is not the ground truth.
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


@dataclass(frozen=True)
class Example:
    """A chat prompt (list of {"role", "content"} messages) and the ground-truth answer the reward checks."""

    messages: tuple[dict, ...]
    answer: str


def _answer(raw) -> str:
    text = str(raw)
    match = _GSM8K_FINAL.search(text)
    return match.group(1).replace(",", "") if match else text.strip()


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}); each line must be one object") from None
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported prompt file type {path.suffix!r}; use .jsonl or .parquet")


def load_examples(path: str | Path, *, prompt_key: str = "question", answer_key: str = "answer",
                  system_prompt: str | None = None, instruction: str = "") -> list[Example]:
    """Read prompts and answers. `prompt_key` may hold a string (the user turn; `instruction` is appended) or a
    list of chat messages; GSM8K-style answers ("... #### 72") keep only the final answer."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    rows = _rows(path)
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    examples = []
    for index, row in enumerate(rows):
        missing = [k for k in (prompt_key, answer_key) if k not in row]
        if missing:
            raise KeyError(f"{path} row {index} has no {missing} (it has {sorted(row)}); "
                           "set the prompt/answer keys in the data config")
        prompt = row[prompt_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": f"{prompt}{instruction}"}]
        else:
            messages = [dict(m) for m in prompt]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        examples.append(Example(tuple(messages), _answer(row[answer_key])))
    return examples
