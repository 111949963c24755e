"""Prompt sets: one `Example` per prompt, from JSONL or Parquet files in GSM8K/MATH style."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

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


def _rows(path: Path, limit: int | None) -> Iterator[tuple[str, object]]:
    """(where, row) for the file's rows, the first `limit` only if given; `where` is path:line or path row N."""
    if path.suffix == ".jsonl":
        with path.open() as f:
            count = 0
            for number, line in enumerate(f, 1):
                if limit is not None and count >= limit:
                    return
                if line.strip():
                    count += 1
                    try:
                        yield f"{path}:{number}", json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}); each line must be one "
                                         "object") from None
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(path).iter_batches(batch_size=limit) if limit else [pq.read_table(path)]
        for batch in rows:
            for index, row in enumerate(batch.to_pylist()):
                yield f"{path} row {index}", row
            if limit:
                return
        return
    raise ValueError(f"{path}: unsupported prompt file type {path.suffix!r}; use .jsonl or .parquet")


def _messages(where: str, prompt, instruction: str) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": f"{prompt}{instruction}"}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                   for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"{where}: the prompt must be a string or a list of {{role, content}} messages, "
                     f"got {type(prompt).__name__} {str(prompt)[:80]!r}")


def load_examples(path: str | Path, *, prompt_key: str = "question", answer_key: str = "answer",
                  system_prompt: str | None = None, instruction: str = "",
                  limit: int | None = None) -> list[Example]:
    """Read prompts and answers (the first `limit` rows only, if given: a quick check of a file). `prompt_key`
    may hold a string (the user turn; `instruction` is appended) or a list of chat messages; GSM8K-style
    answers ("... #### 72") keep only the final answer. A bad row raises ValueError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    examples = []
    for where, row in _rows(path, limit):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be an object with {prompt_key!r} and {answer_key!r}, "
                             f"got {type(row).__name__}")
        missing = [k for k in (prompt_key, answer_key) if k not in row]
        if missing:
            raise ValueError(f"{where} has no {missing} (it has {sorted(row)}); set data.prompt_key / "
                             "data.answer_key to the file's keys")
        messages = _messages(where, row[prompt_key], instruction)
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        examples.append(Example(tuple(messages), _answer(row[answer_key])))
    if not examples:
        raise ValueError(f"{path} holds no prompts")
    return examples
