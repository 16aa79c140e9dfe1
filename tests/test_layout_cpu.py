"""The package's shape, checked (CPU): no import circle among cupy_fa's modules (imports inside
functions counted too), no module much over 500 lines, every kernel file in its family's folder,
and every ``#include`` of the kernels written from the kernels/ root."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupy_fa"
KERNELS = ROOT / "kernels"
MAX_LINES = 520  # "about 500"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path):
    """The cupy_fa modules a file imports, anywhere in it (relative or absolute)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in modules and c != name}
    return found


def test_no_import_circle():
    graph = {module_name(p): package_imports(p) for p in PACKAGE.rglob("*.py")}
    # a package's __init__ importing its own modules is not a circle with them
    for name in graph:
        graph[name] = {d for d in graph[name] if not (d.startswith(name + ".") or name.startswith(d + "."))}
    state = {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert "cupy_fa.schedule" in graph and graph["cupy_fa.families.mma_sync"] <= {"cupy_fa._compile", "cupy_fa.knobs",
                                                                               "cupy_fa.families.common"}


def test_no_module_much_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_kernels_live_in_their_familys_folder_and_include_from_the_root():
    files = [p.relative_to(KERNELS) for p in KERNELS.rglob("*") if p.is_file()]
    assert files and {p.parts[0] for p in files} == {"shared", "mma_sync", "sm90", "mla"}
    assert all(len(p.parts) == 2 and p.suffix in (".cu", ".cuh") for p in files), files
    names = {p.as_posix() for p in files}
    for path in KERNELS.rglob("*.cu*"):
        for include in re.findall(r'#include "([^"]+)"', path.read_text()):
            assert include in names, f"{path.relative_to(ROOT)} includes {include!r}, not a path from kernels/"
    # a family's files name no family (the folder does); shared/ holds what several kernels use
    assert not [n for n in names if re.search(r"/(sm90|mma_sync)_", n)]


def test_every_kernel_source_the_catalog_names_exists():
    from cupy_fa import catalog

    sources = {k.source for k in catalog.all_kernels()}
    assert sources == {"shared/plan.cu", "shared/stage.cu", "shared/merge.cu", "shared/merge_states.cu",
                       "shared/kv_append.cu", "mma_sync/attention.cu", "sm90/prefill.cu",
                       "mla/attention.cu", "mla/wgmma.cu", "mla/latent_append.cu"}  # cupy_fa.mla
    assert all((KERNELS / s).is_file() for s in sources)


def test_the_wheel_lists_every_package_and_kernel_folder():
    """pyproject.toml's setuptools packages hold every package of cupy_fa/ (a folder with an
    __init__.py), so an installed wheel imports what the checkout does; its package data takes every
    kernel folder's sources."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= set(tool["packages"]), f"packages missing from pyproject.toml: {sorted(found - set(tool['packages']))}"
    assert set(tool["packages"]) - found == {"cupy_fa.kernels"}  # kernels/, mapped by package-dir
    assert tool["package-dir"] == {"cupy_fa.kernels": "kernels"}
    sources = {p.relative_to(ROOT / "kernels") for p in (ROOT / "kernels").rglob("*") if p.suffix in (".cu", ".cuh")}
    assert sources and all(len(p.parts) == 2 for p in sources)  # each in one folder: the "*/*.cu*" globs take it
    assert tool["package-data"]["cupy_fa.kernels"] == ["*/*.cu", "*/*.cuh"]
