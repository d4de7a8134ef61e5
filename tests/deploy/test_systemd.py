"""deploy/systemd.py: one unit per Procfile process, running the Procfile's own command."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

from deploy.procfile import command_argv, read_env_file, read_procfile
from deploy.systemd import write_units

ROOT = Path(__file__).resolve().parents[2]
ENV_FILE = Path("/etc/hearth/hearth.env")


def read_unit(path: Path) -> configparser.ConfigParser:
    # strict=False: a unit may repeat a key (EnvironmentFile); the parser keeps the last.
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # keys are case-sensitive
    unit.read_string(path.read_text())
    return unit


def test_each_procfile_process_gets_a_unit_that_runs_its_line(tmp_path):
    written = write_units(tmp_path, ENV_FILE, ROOT, "hearth", python=sys.executable)
    assert sorted(path.name for path in written) == [
        "hearth-gateway.service",
        "hearth-node@.service",
        "hearth-sweeper.service",
        "hearth-worker.service",
    ]
    env = read_env_file()
    for process, command in read_procfile().items():
        name = f"hearth-{process}@.service" if process == "node" else f"hearth-{process}.service"
        text = (tmp_path / name).read_text()
        service = read_unit(tmp_path / name)["Service"]
        assert service["WorkingDirectory"] == str(ROOT) and service["User"] == "hearth"
        assert f"EnvironmentFile={ENV_FILE}\n" in text
        # systemd puts each ${NAME} in as one word: what the Procfile's line means.
        words = service["ExecStart"].split()
        substituted = [command_argv(word, env)[0] if "$" in word else word for word in words]
        assert substituted == [sys.executable, *command_argv(command, env)[1:]]
    node = (tmp_path / "hearth-node@.service").read_text()
    # Several nodes a host, each with its own id and model in node-<instance>.env, read last.
    assert node.index(f"EnvironmentFile={ENV_FILE}\n") < node.index(
        "EnvironmentFile=-/etc/hearth/node-%i.env\n"
    )
    assert "TimeoutStopSec=600" in node  # time to drain


def test_systemd_accepts_the_units(tmp_path):
    import getpass

    write_units(tmp_path, ENV_FILE, ROOT, getpass.getuser(), python=sys.executable)
    units = sorted(str(path) for path in tmp_path.glob("*.service"))
    done = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stdout + done.stderr
