"""deploy/Procfile and deploy/hearth.env.example as data: the production processes' commands, and
the environment they read.

A Procfile line is `name: command`; other lines (comments) are not processes, as honcho and
foreman read it. A command names what varies as `$NAME` or `${NAME}`; `command_argv` splits it
into words first and then substitutes, so a value stays one word (as systemd's `${NAME}` and the
shell's `"$NAME"` do), and a variable the environment lacks is an error rather than an empty word.
The environment file holds `NAME=value` lines; `#NAME=value` is a variable listed but left at its
default.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

DEPLOY_DIR = Path(__file__).resolve().parent
PROCFILE = DEPLOY_DIR / "Procfile"
ENV_EXAMPLE = DEPLOY_DIR / "hearth.env.example"

_PROCESS_LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_ASSIGNMENT = re.compile(r"^(#)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def read_procfile(path: Path = PROCFILE) -> dict[str, str]:
    """{process name: command}, in the file's order."""
    processes = {}
    for line in path.read_text().splitlines():
        match = _PROCESS_LINE.match(line.strip())
        if match:
            processes[match.group(1)] = match.group(2).strip()
    return processes


def variables_of(command: str) -> list[str]:
    """The environment variables `command` refers to, in order of first use."""
    return list(dict.fromkeys(a or b for a, b in VARIABLE.findall(command)))


def command_argv(command: str, env: Mapping[str, str]) -> list[str]:
    """`command` as an argument vector, each `$NAME` replaced by `env[NAME]`; raises KeyError
    naming every variable `env` lacks."""
    missing = [name for name in variables_of(command) if name not in env]
    if missing:
        raise KeyError(f"{command!r} needs {', '.join(missing)} in its environment")
    return [
        VARIABLE.sub(lambda match: env[match.group(1) or match.group(2)], word)
        for word in shlex.split(command)
    ]


def read_env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """{NAME: value} of the file's assignments, those commented out left out."""
    return {
        match.group(2): match.group(3)
        for line in path.read_text().splitlines()
        if (match := _ASSIGNMENT.match(line.strip())) and not match.group(1)
    }


def listed_variables(path: Path = ENV_EXAMPLE) -> set[str]:
    """Every variable the file names in an assignment, commented out or not."""
    return {
        match.group(2)
        for line in path.read_text().splitlines()
        if (match := _ASSIGNMENT.match(line.strip()))
    }
