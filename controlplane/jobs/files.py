"""Files: OpenAI's File object (`file-…`), stored in the database.

A batch's input file and the output and error files the batch writes are rows here, bytes and
all: a file is at most `FILES_MAX_BYTES` (50 MB by default), PostgreSQL keeps a `bytea` of that
size without trouble, and one store means a file can never outlive or miss its metadata. An
input file (`purpose: "batch"`) is checked line by line when it is uploaded, so a bad line is a
400 naming its line number at once rather than a failed batch later.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import models

# The URLs a batch line may name, and the Job endpoint each maps to.
BATCH_URLS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileRejected(Exception):
    """An upload that is not valid for its purpose; `line` (1-based) names the bad line."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message if line is None else f"Line {line}: {message}")
        self.line = line


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch input file."""

    line: int
    custom_id: str
    url: str
    body: dict


def parse_batch_lines(content: bytes) -> list[BatchLine]:
    """The requests of a batch input file, or FileRejected naming the first bad line.

    Each non-blank line is a JSON object `{custom_id, method: "POST", url, body}`: `custom_id` a
    string unique in the file, `url` one of BATCH_URLS, `body` an object (its fields are checked
    when the batch is created, against the endpoint's own validation)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FileRejected(f"the file is not UTF-8 text ({error})") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) >= settings.BATCH_MAX_LINES:
            raise FileRejected(
                f"a batch file may hold at most {settings.BATCH_MAX_LINES} requests", number
            )
        try:
            entry = json.loads(raw)
        except ValueError as error:
            raise FileRejected(f"not valid JSON ({error})", number) from None
        if not isinstance(entry, dict):
            raise FileRejected("each line must be a JSON object", number)
        custom_id = entry.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise FileRejected("'custom_id' must be a non-empty string", number)
        if custom_id in seen:
            raise FileRejected(f"the custom_id '{custom_id}' appears more than once", number)
        seen.add(custom_id)
        if entry.get("method") != "POST":
            raise FileRejected("'method' must be \"POST\"", number)
        if entry.get("url") not in BATCH_URLS:
            raise FileRejected(f"'url' must be one of {sorted(BATCH_URLS)}", number)
        if not isinstance(entry.get("body"), dict):
            raise FileRejected("'body' must be a JSON object", number)
        unknown = set(entry) - {"custom_id", "method", "url", "body"}
        if unknown:
            raise FileRejected(f"unknown fields {sorted(unknown)}", number)
        lines.append(BatchLine(number, custom_id, entry["url"], entry["body"]))
    if not lines:
        raise FileRejected("the file holds no requests")
    return lines


class FileManager(models.Manager["File"]):
    def upload(self, org, filename: str, purpose: str, content: bytes) -> File:
        """Store an uploaded file after checking it for its purpose; FileRejected otherwise."""
        if len(content) > settings.FILES_MAX_BYTES:
            raise FileRejected(f"files may be at most {settings.FILES_MAX_BYTES} bytes")
        if purpose == File.BATCH:
            parse_batch_lines(content)
        return self.create(
            org=org, filename=filename, purpose=purpose, bytes=len(content), content=content
        )


class File(models.Model):
    """A stored file: a batch's input (`batch`), or what a batch wrote (`batch_output`)."""

    BATCH, BATCH_OUTPUT = "batch", "batch_output"
    PURPOSES = [(BATCH, BATCH), (BATCH_OUTPUT, BATCH_OUTPUT)]

    id = models.CharField(primary_key=True, max_length=40, default=new_file_id)
    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="files")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=16, choices=PURPOSES)
    bytes = models.PositiveBigIntegerField()
    content = models.BinaryField()
    created = models.DateTimeField(auto_now_add=True)

    objects = FileManager()

    class Meta:
        indexes = [models.Index(fields=["org", "-created", "-id"], name="file_org_created")]

    def as_object(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created.timestamp()),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",  # checked on upload, so never `uploaded` or `error`
        }
