"""No code path loads serialized data or code that data could name, but the reviewed ones: the
project's modules are scanned for calls that run code from bytes or strings (``pickle`` and
kin, ``eval``/``exec``, ``yaml.load``, imports by a computed name, ``subprocess`` through a
shell). Each allowed call is listed with why it is safe (``docs/reliability.md``, channels)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("statestore", "catalog", "spark_integration")

# Calls that turn bytes or text into objects or code, by their dotted name as written.
LOADERS = {
    "pickle.loads", "pickle.load", "cloudpickle.loads", "cloudpickle.load", "marshal.loads", "marshal.load",
    "dill.loads", "dill.load", "shelve.open", "yaml.load", "yaml.unsafe_load", "yaml.full_load", "numpy.load",
    "np.load", "pandas.read_pickle", "pd.read_pickle", "importlib.import_module", "os.system", "os.popen",
    "runpy.run_path", "runpy.run_module",
}
# Builtins, matched by their bare name only (``re.compile`` is not ``compile``).
BUILTINS = {"eval", "exec", "compile", "__import__"}
# (module, function, call): the reviewed ones.
ALLOWED = {
    # The processor's exception, loaded only from an envelope whose HMAC the query's key proves.
    ("spark_integration/errors.py", "user_error", "cloudpickle.loads"),
    # Lazy package exports: module names from the package's own constant table.
    ("statestore/exports.py", "__getattr__", "importlib.import_module"),
    # The S3 retry strategy named by the catalog's configuration (a table's metadata may not set
    # it: catalog.fileio.check_no_code_from_metadata).
    ("catalog/fileio.py", "s3_retry_options", "importlib.import_module"),
}


def dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def calls_in(path: Path) -> list[tuple[str, str, int]]:
    """(enclosing function, call, line) of every loader call in ``path``, shell subprocesses included."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    # Names bound by ``from pickle import loads`` (as ``loads``) and ``import pickle as p``.
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname})

    def resolved(name: str | None) -> str | None:
        if name is None:
            return None
        head, _, rest = name.partition(".")
        return f"{aliases[head]}.{rest}".rstrip(".") if head in aliases else name

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                called = resolved(dotted(child.func))
                loader = called if called in BUILTINS else next(
                    (x for x in LOADERS if called is not None and (called == x or called.endswith(f".{x}"))), None)
                if loader is not None:
                    found.append((function, loader, child.lineno))
                shell = [k for k in child.keywords if k.arg == "shell" and not (
                    isinstance(k.value, ast.Constant) and k.value.value is False)]
                if shell:
                    found.append((function, f"{called}(shell=...)", child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_only_reviewed_calls_load_code_or_serialized_data():
    unexpected, seen = [], set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = str(path.relative_to(ROOT))
            for function, called, line in calls_in(path):
                seen.add((module, function, called))
                if (module, function, called) not in ALLOWED:
                    unexpected.append(f"{module}:{line} {function}: {called}")
    assert unexpected == [], "calls that load code or serialized data, not reviewed:\n" + "\n".join(unexpected)
    assert seen >= ALLOWED, f"reviewed calls no longer in the code (update the list): {ALLOWED - seen}"


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """The scanner itself: each kind of call is found, inside functions and at module level."""
    source = tmp_path / "m.py"
    source.write_text("import pickle, subprocess, yaml\nimport marshal as m\nfrom pyspark.cloudpickle import loads\n"
                      "x = eval('1')\n"
                      "def f(b):\n    return pickle.loads(b), m.loads(b), loads(b)\n"
                      "def g(s):\n    subprocess.run(s, shell=True)\n    return yaml.load(s)\n")
    assert calls_in(source) == [("<module>", "eval", 4), ("f", "pickle.loads", 6), ("f", "marshal.loads", 6),
                                ("f", "cloudpickle.loads", 6), ("g", "subprocess.run(shell=...)", 8),
                                ("g", "yaml.load", 9)]
