"""The package's shape: no import circle among its modules, no module reaching into another's
private names, and the top-level names."""
import ast
import pathlib

import expertact

PACKAGE = pathlib.Path(expertact.__file__).resolve().parent


def _modules():
    """Dotted name (relative to expertact, "" for its __init__) -> file, for every module."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _from_module(node, name, path):
    """The package module (dotted, relative to expertact) an ImportFrom node imports from, or
    None when it imports from outside the package."""
    here = name.split(".") if name else []
    pkg = here if path.name == "__init__.py" else here[:-1]
    if node.level:
        base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else list(pkg)
        return ".".join(base + ([node.module] if node.module else []))
    if node.module == "expertact" or (node.module or "").startswith("expertact."):
        return node.module[len("expertact."):] if "." in node.module else ""
    return None


def _imports(name, path, modules):
    """The package's modules that `name` imports, at any depth of its code (a function-level
    import closes a circle as surely, at call time, as one at the top)."""
    out = set()

    def add(dotted):
        # the module itself, or else the package whose attribute it is
        while dotted not in modules and dotted:
            dotted = dotted.rpartition(".")[0]
        out.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "expertact" or alias.name.startswith("expertact."):
                    add(alias.name[len("expertact."):] if "." in alias.name else "")
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, name, path)
            if mod is None:
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}" if mod else alias.name
                add(sub if sub in modules else mod)
    out.discard(name)
    return out


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A module's package __init__ runs before it anyway: an edge to an enclosing package is
    # not a circle of the module's own making, so only edges between modules count, plus
    # those into a package from outside it.
    def counted(src, dst):
        return not (dst == "" or src.startswith(dst + "."))

    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if not counted(n, m):
                continue
            if state.get(m) == "open":
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import circle: " + " -> ".join(f"expertact.{c}".rstrip(".") for c in cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)
    # The split of the Python layer, one concern a module, each importing only those below it.
    for low, high in (("_capi", "_ops"), ("_ops", "_library"), ("_library", "_autograd"), ("_eager", "_autograd"),
                      ("_args", "_autograd"), ("_autograd", "functional"), ("_autograd", "deepspeed"),
                      ("_ops", "fp8"), ("moe._gemm", "moe._bf16"), ("moe._bf16", "moe._fp8")):
        assert low in graph[high], (low, high)
    # Tooling stands on the library, never the other way round.
    for name, deps in graph.items():
        if name != "bench" and not name.startswith("bench."):
            assert not any(d == "bench" or d.startswith("bench.") for d in deps), (name, deps)
    assert any(d == "moe" for d in graph["bench.mlp"])  # the check sees the bench modules' edges


def _private_uses(name, path, modules):
    """Places where module `name` takes another package module's private name (one with a
    leading underscore that is not itself a module): `from .x import _y`, or `x._y` with x an
    imported package module. Private modules (_capi, _ops, ...) are the package's layers and
    may be imported; their private names may not."""
    tree = ast.parse(path.read_text(), str(path))
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _from_module(node, name, path)
            if mod is None:
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}" if mod else alias.name
                if sub in modules:
                    bound.add(alias.asname or alias.name)
                elif alias.name.startswith("_") and not alias.name.startswith("__") and mod != name:
                    found.append(f"{path.name}:{node.lineno}: from {mod or 'expertact'} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("expertact.") and alias.asname:
                    bound.add(alias.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_names_across_modules():
    modules = _modules()
    bad = [use for name, path in modules.items() for use in _private_uses(name, path, modules)]
    assert not bad, "private names taken from another module:\n" + "\n".join(bad)


def test_top_level_names():
    for name in ("glu", "swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh", "LAYOUTS", "ACTIVATIONS", "PRESETS",
                 "deepspeed", "moe", "ops", "DTypeError", "ExpertactError", "has_cuda"):
        assert hasattr(expertact, name) and name in expertact.__all__, name
    assert expertact.PRESETS["swiglu_oai"][3] == 1.0 and expertact.LAYOUTS["interleaved"] == 3
    assert issubclass(expertact.DTypeError, TypeError) and issubclass(expertact.DTypeError, ValueError)
