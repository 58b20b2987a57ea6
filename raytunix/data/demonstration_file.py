"""Demonstrations for the warm start from a file (``warmup.demonstrations``): chat-format
rows as Hugging Face datasets hold them, one conversation per row::

    {"messages": [{"role": "user", "content": "Guess a number between 1 and 20."},
                  {"role": "assistant", "content": "[10]"},
                  {"role": "user", "content": "The target number is higher."},
                  {"role": "assistant", "content": "[15]"}]}

in JSONL (one object a line) or parquet (a ``messages`` column of lists of structs).

The first message (after an optional system message) is what the environment's first
observation would be; every later user or tool message is an observation the environment
sent back, and the assistant messages are what the model learns to write (the loss is on
them only). A system message is replaced by the agent's own system prompt, which is what
the model sees during RL; ``read_demonstrations`` counts the rows that had one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

ROLES = ("system", "user", "assistant", "tool")
OBSERVATION_ROLES = ("user", "tool")


class DemonstrationError(ValueError):
    """A demonstrations file cannot be read, or one of its rows is not a conversation the
    agent can be taught; the message names the file, the row and what is wrong."""


@dataclasses.dataclass(frozen=True)
class FileDemonstrations:
    """The rows of a demonstrations file, checked.

    Attributes:
      conversations: per row, ``[{"role": "user", ...}, {"role": "assistant", ...},
        ({"role": "tool", ...}, {"role": "assistant", ...})*]`` (later observations,
        user or tool in the file, all say ``tool``: what ``render_demonstration`` reads
        as an observation); the row's own system message and trailing observations
        (they carry no loss) are left out.
      rows: the file's row number (0-based) of each conversation.
      system_replaced: how many rows had a system message (replaced by the agent's).
    """

    conversations: list[list[dict[str, str]]]
    rows: list[int]
    system_replaced: int


def read_demonstrations(path: str) -> FileDemonstrations:
    """Reads and checks every row of a ``.jsonl`` / ``.json`` or ``.parquet`` file.

    Raises:
      DemonstrationError: the file is missing, of another kind, has no ``messages``
        column or no row; or a row (named by number) is not JSON, has no ``messages``
        list, a message without a string ``role``/``content``, an unknown role, a system
        message after the first, no assistant message, two assistant or two observation
        messages in a row, or does not start with a user message.
    """
    if not os.path.isfile(path):
        raise DemonstrationError(
            f"warmup.demonstrations={path!r}: no such file; give a chat-format .jsonl or "
            ".parquet file with a messages column."
        )
    records = _parquet_records(path) if path.endswith(".parquet") else _jsonl_records(path)
    if not records:
        raise DemonstrationError(f"warmup.demonstrations={path!r} holds no row.")
    conversations, replaced = [], 0
    for row, record in enumerate(records):
        messages, had_system = check_conversation(record, f"{path} row {row}")
        conversations.append(messages)
        replaced += had_system
    return FileDemonstrations(conversations, list(range(len(records))), replaced)


def _jsonl_records(path: str) -> list[Any]:
    if not path.endswith((".jsonl", ".json")):
        raise DemonstrationError(
            f"warmup.demonstrations={path!r}: a demonstrations file ends in .jsonl (one JSON "
            "object a line) or .parquet."
        )
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DemonstrationError(
                    f"{path} row {len(records)} (line {line_number + 1}) is not JSON: {e}"
                ) from None
    return records


def _parquet_records(path: str) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DemonstrationError(f"{path} cannot be read as parquet: {e}") from None
    if "messages" not in table.column_names:
        raise DemonstrationError(
            f"{path} has no messages column (it has {', '.join(table.column_names) or 'none'}); "
            "each row's messages is a list of {role, content}."
        )
    return [{"messages": m} for m in table.column("messages").to_pylist()]


def check_conversation(record: Any, where: str) -> tuple[list[dict[str, str]], bool]:
    """One row (``{"messages": [...]}``) as the conversation ``FileDemonstrations``
    holds, and whether it had a system message.

    Raises:
      DemonstrationError: see ``read_demonstrations``; the message starts with ``where``.
    """
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise DemonstrationError(
            f"{where}: no messages (got {_short(messages)}); each row needs "
            '"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}].'
        )
    roles = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            raise DemonstrationError(
                f"{where} message {i}: unknown role {role!r}; roles are {', '.join(ROLES)}."
            )
        if not isinstance(content, str):
            raise DemonstrationError(
                f"{where} message {i} ({role}): content is {_short(content)}, not text; a tool "
                "call is written in the agent's format inside the assistant's content."
            )
        if role == "system" and i > 0:
            raise DemonstrationError(f"{where} message {i}: a system message only comes first.")
        roles.append(role)
    had_system = roles[0] == "system"
    body = list(messages[1:] if had_system else messages)
    return _alternating(body, where, int(had_system)), had_system


def _alternating(body: list[Any], where: str, offset: int) -> list[dict[str, str]]:
    if not body or body[0]["role"] != "user":
        raise DemonstrationError(
            f"{where}: the first message must be the user's (the task), got "
            f"{body[0]['role'] if body else 'nothing'}."
        )
    if not any(m["role"] == "assistant" for m in body):
        raise DemonstrationError(
            f"{where}: no assistant message, so nothing to learn; a demonstration holds the "
            "model's replies as assistant messages."
        )
    while body[-1]["role"] != "assistant":  # an observation after the last reply: no loss
        body = body[:-1]
    out = [{"role": "user", "content": body[0]["content"]}]
    for i, message in enumerate(body[1:], start=1):
        observation = message["role"] in OBSERVATION_ROLES
        if observation == (out[-1]["role"] != "assistant"):
            kind = "observation (user or tool)" if observation else "assistant"
            raise DemonstrationError(
                f"{where} message {i + offset}: two {kind} messages in a row; a "
                "demonstration alternates the model's replies and the environment's."
            )
        out.append({"role": "tool" if observation else "assistant", "content": message["content"]})
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
