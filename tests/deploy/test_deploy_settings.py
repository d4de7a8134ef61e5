"""deploy/hearth.env.example against the code: Django's deployment check passes with it, and it
names every environment variable the settings, the node and the Procfile read, so it cannot drift
from them."""

from __future__ import annotations

import ast
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from deploy.procfile import listed_variables, read_env_file, read_procfile, variables_of

ROOT = Path(__file__).resolve().parents[2]
# The typed helpers of controlplane/settings.py.
ENV_HELPERS = {"env_str", "env_bool", "env_int", "env_float"}


def deploy_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`manage.py check --deploy --fail-level WARNING` in a process of its own, with `env` as
    its whole environment (beside PATH and HOME): nothing leaks in from the test run."""
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def production_env() -> dict[str, str]:
    """The example environment with real secrets in place of its `change-me`s."""
    env = read_env_file()
    env["HEARTH_SECRET_KEY"] = secrets.token_urlsafe(50)
    env["HEARTH_METRICS_TOKEN"] = secrets.token_urlsafe(32)
    return env


def variables_read(path: Path) -> Iterator[str]:
    """The environment variables a module reads by name: the settings' helpers,
    `os.environ.get`, `os.getenv` and `os.environ[...]` (a `setdefault` writes, and is left out)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args:
            first, func = node.args[0], ast.unparse(node.func)
            named = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if named and (func in ENV_HELPERS or func in ("os.environ.get", "os.getenv")):
                yield first.value
        elif (
            isinstance(node, ast.Subscript)
            and ast.unparse(node.value) == "os.environ"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.ctx, ast.Load)
        ):
            yield node.slice.value


def test_the_deploy_check_passes_with_the_example_environment_and_real_secrets():
    done = deploy_check(production_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


def test_the_deploy_check_refuses_the_example_left_as_it_is():
    """The `change-me` secret key is too short to pass, so a copy of the example whose secrets
    were never replaced fails the check."""
    done = deploy_check(read_env_file())
    assert done.returncode != 0
    assert "security.W009" in done.stderr, done.stdout + done.stderr


def test_the_deploy_check_refuses_the_laptop_defaults():
    """Without the example's HTTPS settings the check fails: it is the example that passes."""
    env = production_env()
    for name in list(env):
        if name.startswith("HEARTH_SECURE_"):
            del env[name]
    done = deploy_check(env)
    assert done.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in done.stderr, done.stdout + done.stderr


def test_every_variable_the_code_reads_is_in_the_example():
    modules = [
        *sorted((ROOT / "controlplane").rglob("*.py")),
        *sorted((ROOT / "inference").rglob("*.py")),
        *sorted((ROOT / "kernels").rglob("*.py")),
    ]
    read = {name: path for path in modules for name in variables_read(path)}
    # The collector finds the settings' reads at all (else this test would pass on nothing).
    assert {"DATABASE_URL", "HEARTH_SECRET_KEY", "HEARTH_DB_POOL_SIZE", "HEARTH_CACHE_DIR"} <= set(
        read
    )
    missing = {name: str(path.relative_to(ROOT)) for name, path in read.items()}
    for name in listed_variables():
        missing.pop(name, None)
    assert not missing, f"read by the code but not in deploy/hearth.env.example: {missing}"


def test_every_variable_in_the_example_is_read_by_something():
    """No stale entries: each is read by Hearth's code, a Procfile line, or the one library
    named here that reads it itself."""
    read_by_libraries = {"FORWARDED_ALLOW_IPS": "uvicorn", "OMP_NUM_THREADS": "torch"}
    modules = [*(ROOT / "controlplane").rglob("*.py"), *(ROOT / "inference").rglob("*.py")]
    modules += [*(ROOT / "kernels").rglob("*.py")]
    read = {name for path in modules for name in variables_read(path)}
    read |= {name for command in read_procfile().values() for name in variables_of(command)}
    assert listed_variables() - read == set(read_by_libraries)


def test_every_variable_of_the_procfile_has_a_value_in_the_example():
    """A Procfile variable has no default: the example gives it a value, not a comment."""
    processes = read_procfile()
    assert set(processes) == {"gateway", "worker", "sweeper", "node"}
    values = read_env_file()
    for name, command in processes.items():
        for variable in variables_of(command):
            assert values.get(variable), f"{name} needs {variable}"
