"""The package's imports go one way: a module imports from its own layer and the layers below it, never
from a layer above (README "Layout", gptcuda/__init__.py). Every import counts: at module level and
inside functions, `from gptcuda... import` and `import gptcuda...`."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gptcuda"

# The layers from the bottom up, each a tuple of what lies directly in gptcuda/ (a module file or a package
# "name/"). The utilities import no layer; cli.py and launch.py (used by the scripts only) may import any.
LAYERS = (
    ("__init__.py", "files.py", "errors.py", "faults.py", "config.py"),
    ("runtime/",),
    ("model/",),
    ("ops/",),
    ("data/",),
    ("dist/",),
    ("interop/",),
    ("training/",),
    ("generate/",),
    ("cli.py", "launch.py"),
)
RANK = {entry: i for i, layer in enumerate(LAYERS) for entry in layer}


def entry_of(module: str) -> str:
    """The LAYERS entry a dotted module name under gptcuda belongs to ("gptcuda.ops.cuda.gemm" -> "ops/")."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return parts[0] + "/" if (PACKAGE / parts[0]).is_dir() else parts[0] + ".py"


def _exists(module: str) -> bool:
    p = ROOT.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(source: str, module: str, is_package: bool = False):
    """(line, module imported) for every gptcuda import in source, the source of `module`, wherever it
    stands; `from X import name` counts as X.name where that is a module (`from gptcuda import faults`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if a.name != "*" and _exists(sub) else base))
    return [(line, m) for line, m in dict.fromkeys(out) if m == "gptcuda" or m.startswith("gptcuda.")]


def modules():
    """(path, dotted name, is a package's __init__) of every module under gptcuda/."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        init = parts[-1] == "__init__"
        yield path, ".".join(parts[:-1] if init else parts), init


def test_every_module_has_a_layer():
    missing = sorted({entry_of(name) for _, name, _ in modules()} - set(RANK))
    assert not missing, f"place these in LAYERS (and README's Layout): {missing}"
    gone = [e for e in RANK if not (PACKAGE / e).exists()]
    assert not gone, f"LAYERS names what gptcuda/ no longer has: {gone}"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path, name, init in modules():
        own = entry_of(name)
        for line, target in imports_of(path.read_text(encoding="utf-8"), name, init):
            if RANK[entry_of(target)] > RANK[own]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {target} ({entry_of(target)})")
    assert not upward, "imports from a higher layer:\n  " + "\n  ".join(upward)


def test_imports_are_found_wherever_they_stand():
    src = ("import os\nimport gptcuda.training.engine\nfrom gptcuda import faults\n"
           "def f():\n    from gptcuda.model import rng\n    from gptcuda.cli import UsageError\n"
           "class C:\n    def g(self):\n        from . import buckets\n        from .env import DistError\n")
    got = imports_of(src, "gptcuda.dist.parallel")
    assert got == [(2, "gptcuda.training.engine"), (3, "gptcuda.faults"), (5, "gptcuda.model.rng"),
                   (6, "gptcuda.cli"), (9, "gptcuda.dist.buckets"), (10, "gptcuda.dist.env")]
    assert [entry_of(m) for _, m in got] == ["training/", "faults.py", "model/", "cli.py", "dist/", "dist/"]


def test_the_readme_lists_the_layers_in_this_order():
    """README's Layout block names each entry on a line of its own layer (a line starting "gptcuda/"),
    the layers' lines in LAYERS' order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M).group(1)
    lines = [ln for ln in block.splitlines() if ln.startswith("gptcuda/")]

    def line_of(entry):
        pat = re.compile(r"(^gptcuda/|\s)" + re.escape(entry) + r"(\s|$)")
        return next((i for i, ln in enumerate(lines) if pat.search(ln)), None)

    where = {e: line_of(e) for layer in LAYERS for e in layer if e != "__init__.py"}
    assert None not in where.values(), f"not in README's Layout: {[e for e, i in where.items() if i is None]}"
    spans = [(min(where[e] for e in layer if e in where), max(where[e] for e in layer if e in where))
             for layer in LAYERS]
    for (lo, hi), (nlo, _), a, b in zip(spans, spans[1:], LAYERS, LAYERS[1:]):
        assert hi < nlo, f"README's Layout lists {b} before (or beside) {a}"
