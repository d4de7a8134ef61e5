"""systemd units for Hearth's production processes, written from deploy/Procfile.

    python -m deploy.systemd --env-file /etc/hearth/hearth.env --directory /opt/hearth \\
        --user hearth --output /etc/systemd/system

writes `hearth-gateway.service`, `hearth-worker.service`, `hearth-sweeper.service` and the
template `hearth-node@.service`: each runs its Procfile line from `--directory` (a checkout with
its virtual environment) with the variables of `--env-file`. A host runs several nodes as
`hearth-node@0`, `hearth-node@1`, …; each reads `node-<instance>.env` beside the env file after
it (its HEARTH_NODE_ID, HEARTH_NODE_MODEL, OMP_NUM_THREADS). docs/deploy.md shows the steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deploy.procfile import PROCFILE, VARIABLE, read_procfile

# Processes a host may run several of: a template unit, one instance each.
TEMPLATES = frozenset({"node"})
# A node stops by draining (it finishes the requests it runs, then exits): give it that long
# before systemd kills it, as long as the longest synchronous request may take (the default of
# HEARTH_SYNC_REQUEST_TIMEOUT_S). Other processes keep systemd's default.
STOP_TIMEOUT_S = {"node": 600}


def unit_name(process: str) -> str:
    """The unit file's name for a Procfile process."""
    return f"hearth-{process}@.service" if process in TEMPLATES else f"hearth-{process}.service"


def exec_start(command: str, python: str) -> str:
    """The Procfile command as systemd's ExecStart: its `python` the virtual environment's, each
    `$NAME` written `${NAME}` (one word, as the Procfile means it)."""
    program, _, arguments = command.partition(" ")
    if program != "python":
        raise ValueError(f"a Procfile command should start with `python`: {command!r}")
    braced = VARIABLE.sub(lambda match: "${" + (match.group(1) or match.group(2)) + "}", arguments)
    return f"{python} {braced}"


def render_unit(
    process: str, command: str, env_file: Path, directory: Path, user: str, python: str
) -> str:
    """One unit file's text."""
    environment = [f"EnvironmentFile={env_file}"]
    if process in TEMPLATES:
        # `-`: the instance's own file is optional; read after the shared one, it wins.
        environment.append(f"EnvironmentFile=-{env_file.parent / f'{process}-%i.env'}")
    stop = [f"TimeoutStopSec={STOP_TIMEOUT_S[process]}"] if process in STOP_TIMEOUT_S else []
    instance = " %i" if process in TEMPLATES else ""
    lines = [
        f"# Written by `python -m deploy.systemd` from deploy/Procfile's `{process}` line.",
        "[Unit]",
        f"Description=Hearth {process}{instance}",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"User={user}",
        f"WorkingDirectory={directory}",
        *environment,
        "Environment=PYTHONUNBUFFERED=1",
        f"ExecStart={exec_start(command, python)}",
        "Restart=on-failure",
        "RestartSec=2",
        *stop,
        "",
        "[Install]",
        "WantedBy=multi-user.target",
    ]
    return "\n".join(lines) + "\n"


def write_units(
    output: Path,
    env_file: Path,
    directory: Path,
    user: str,
    python: str | None = None,
    procfile: Path = PROCFILE,
) -> list[Path]:
    """Write one unit per Procfile process into `output`; the paths written."""
    python = python or str(directory / ".venv" / "bin" / "python")
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for process, command in read_procfile(procfile).items():
        path = output / unit_name(process)
        path.write_text(render_unit(process, command, env_file, directory, user, python))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.systemd", description=__doc__)
    parser.add_argument("--env-file", type=Path, required=True, help="e.g. /etc/hearth/hearth.env")
    parser.add_argument("--directory", type=Path, required=True, help="Hearth's checkout")
    parser.add_argument("--user", required=True, help="the account the processes run as")
    parser.add_argument("--output", type=Path, default=Path("/etc/systemd/system"))
    parser.add_argument("--python", help="default: <directory>/.venv/bin/python")
    args = parser.parse_args(argv)
    for path in write_units(args.output, args.env_file, args.directory, args.user, args.python):
        print(path)


if __name__ == "__main__":
    main()
