"""Log lines that one request id can be followed by, through every process it passes.

`JsonFormatter` writes each record as one JSON object on one line: `time` (UTC, ISO 8601, to the
millisecond), `level`, `logger`, `message`, then the ids of the request being handled, where
known: `request_id`, `job_id`, `org` (the org's slug), `node`; then any other fields the call
passed (`logger.info(..., extra={"status": 200})`), and `exception` with the traceback. The ids
come from the log context, a context variable that each process sets around a request's handling:
the gateway once it has admitted the request (controlplane/gateway/request_metrics.py), the node
around each request's steps (inference/node/node.py), the worker for each job it settles
(controlplane/jobs/job_metrics.py). `grep '"request_id":"req_…"'` over the three logs, or
`jq 'select(.request_id == "req_…")'`, then shows the request's way from admission to settlement.

`TextFormatter` is the plain format for a terminal, with the same ids appended as `key=value`.

Django-free and torch-free (inference/protocol), so the node and the control plane share it: the
control plane's settings name these classes in LOGGING (HEARTH_LOG_FORMAT), the node's entry point
installs one itself (`python -m inference.node --log-format`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

# The fields a request's log lines carry, in the order they are written.
CONTEXT_FIELDS = ("request_id", "job_id", "org", "node")
# What every LogRecord has: anything else on a record came from `extra=`.
_RECORD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_context: ContextVar[Mapping[str, Any]] = ContextVar(
    "hearth_log_context", default=MappingProxyType({})
)


def current_log_context() -> dict[str, Any]:
    """The ids the log lines written now carry (a copy)."""
    return dict(_context.get())


def bind_log_context(**fields: Any) -> None:
    """Add `fields` (None ones left out) to the log context of the rest of the current task or
    thread, for as long as its context lives (a gateway request: its own asyncio task)."""
    _context.set(_merged(fields))


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add `fields` (None ones left out) to the log context inside the `with` block only."""
    token = _context.set(_merged(fields))
    try:
        yield
    finally:
        _context.reset(token)


def _merged(fields: dict[str, Any]) -> dict[str, Any]:
    return {**_context.get(), **{k: v for k, v in fields.items() if v is not None}}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's context ids (in CONTEXT_FIELDS' order) and `extra` fields; an `extra` field
    wins over the context."""
    extra = {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES}
    fields = {**_context.get(), **extra}
    ids = {name: fields.pop(name) for name in CONTEXT_FIELDS if name in fields}
    return {**ids, **fields}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the request's ids, `extra` fields,
    and the exception's traceback if any (module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, UTC)
        entry: dict[str, Any] = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    """`time level logger message`, then the request's ids and `extra` fields as `key=value`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        first, _, rest = line.partition("\n")  # a traceback stays below the line
        pairs = " ".join(f"{name}={value}" for name, value in fields.items())
        return f"{first} {pairs}" + (f"\n{rest}" if rest else "")


FORMATTERS = {"json": JsonFormatter, "text": TextFormatter}


def configure_logging(log_format: str, level: int = logging.INFO) -> None:
    """Log to stderr in `log_format` (`json` or `text`) at `level`: for an entry point with no
    logging set up of its own (`python -m inference.node`). Under Django (`manage.py runnode`)
    the settings' LOGGING has set it up already, and this changes nothing."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[log_format]())
    root.addHandler(handler)
    root.setLevel(level)
