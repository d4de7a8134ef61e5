"""The control plane's layers run one way: a module imports only its own layer and those below.

Read from the source (every import, inside functions too), so a cycle cannot hide in a function
body. docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Lowest first. A module belongs to the first entry that is its name or a package above it.
LAYERS: list[tuple[str, ...]] = [
    (
        "controlplane.settings",
        "controlplane.json_rows",
        "controlplane.joined_rows",
        "controlplane.broker",
        "controlplane.pattern_indexes",
        "controlplane.layer_receive",
    ),
    ("controlplane.catalog",),
    ("controlplane.metrics",),
    ("controlplane.accounts",),
    ("controlplane.api",),
    ("controlplane.events",),
    ("controlplane.billing",),
    ("controlplane.jobs",),
    ("controlplane.dispatch",),
    ("controlplane.gateway", "controlplane.console", "controlplane.openapi"),
    ("controlplane.urls", "controlplane.asgi", "controlplane.embedded", "controlplane"),
]
ENTRY_POINTS = len(LAYERS) - 1  # the layer of what starts processes: it may import anything

# What the control plane may take from inference/: the node's wire protocol and pure helpers that
# keep routing and accounting byte for byte with the engine. Entry points may run a node.
INFERENCE_ALLOWED = (
    "inference.protocol",
    "inference.errors",
    "inference.engine.block_hash",
    "inference.engine.tokenizer",
    "inference.engine.outputs",
    "inference.engine.sampling_params",
    "inference.models.loader",
    "inference.structured.spec",
    "inference.structured.tool_calls",
    "inference.structured.tool_prompt",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def control_plane_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for path in (ROOT / "controlplane").rglob("*.py")
        if "migrations" not in path.parts
    }


def imported_names(path: Path, module: str) -> set[str]:
    """Every module `path` imports, at any depth of its code, resolved to absolute names."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from package import module` imports the module
                submodule = f"{base}.{alias.name}"
                names.add(submodule if is_module(submodule) else base)
    return names


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(module: str) -> int | None:
    if ".management.commands." in module:
        return ENTRY_POINTS
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or module.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def allowed_from_inference(name: str) -> bool:
    """An allowed module, or a package above one (`from inference.protocol import messages`)."""
    return name.startswith(INFERENCE_ALLOWED) or any(
        allowed.startswith(name + ".") for allowed in INFERENCE_ALLOWED
    )


def test_every_control_plane_module_has_a_layer():
    unplaced = [module for module in control_plane_modules() if layer_of(module) is None]
    assert unplaced == []


def test_no_layer_imports_a_higher_one():
    upward = []
    for module, path in sorted(control_plane_modules().items()):
        own = layer_of(module)
        for name in sorted(imported_names(path, module)):
            target = layer_of(name) if name.startswith("controlplane") else None
            if target is not None and target > own:
                upward.append(f"{module} (layer {own}) imports {name} (layer {target})")
    assert upward == []


def test_the_control_plane_takes_only_the_wire_protocol_and_pure_helpers_from_inference():
    taken = []
    for module, path in sorted(control_plane_modules().items()):
        if layer_of(module) == ENTRY_POINTS:
            continue
        for name in sorted(imported_names(path, module)):
            if name.startswith("inference") and not allowed_from_inference(name):
                taken.append(f"{module} imports {name}")
    assert taken == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The reader above finds an import inside a function, relative or absolute."""
    source = tmp_path / "sample.py"
    source.write_text(
        "def late():\n"
        "    from controlplane.gateway import views\n"
        "    from ..dispatch import routing\n"
    )
    names = imported_names(source, "controlplane.jobs.sample")
    assert "controlplane.gateway.views" in names
    assert "controlplane.dispatch.routing" in names
    assert layer_of("controlplane.jobs.sample") < layer_of("controlplane.gateway.views")


def test_the_layers_below_dispatch_load_no_torch():
    """Importing every module below dispatch (all the worker's actors need) leaves torch and
    transformers unloaded: the worker takes only the node's wire protocol. (The gateway loads
    transformers for the models' tokenizers, in dispatch/tokenization.py.)"""
    dispatch = layer_of("controlplane.dispatch")
    modules = [m for m in control_plane_modules() if layer_of(m) < dispatch]
    script = (
        "import importlib, os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'tests.settings')\n"
        "import django\n"
        "django.setup()\n"
        f"for name in {sorted(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_no_control_plane_import_hides_in_a_function():
    """An import inside a function is how a cycle is worked around; the layers leave none (but
    in entry points, which import what they start when they start it)."""
    hidden = []
    for module, path in sorted(control_plane_modules().items()):
        if layer_of(module) == ENTRY_POINTS:
            continue
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "controlplane"
                ):
                    hidden.append(f"{module}.{function.name} imports {node.module}")
    assert hidden == []
