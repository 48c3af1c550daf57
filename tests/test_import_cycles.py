"""No import circle: not among the gptcuda modules (every import counts, inside functions too, as in
test_layers.py), not among the kernel sources' `#include "..."` (kernels/*.cu, *.cuh), and every kernel
file a launcher loads (its VARIANTS) is a source of kernels/ that some launcher loads."""
import re

from test_layers import ROOT, _exists, imports_of, modules

KERNELS = ROOT / "kernels"
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def circles(graph: dict) -> list:
    """The strongly connected components of more than one node, or of a node that reaches itself, of
    {node: set of nodes}, each sorted (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph.get(v, ()):
                    out.append(sorted(comp))
    return out


def module_graph() -> dict:
    """{module: the gptcuda modules it imports}; `from gptcuda.x import name` of a non-module name is
    an import of gptcuda.x (its package's __init__ for a package)."""
    graph = {}
    for path, name, init in modules():
        deps = set()
        for _, target in imports_of(path.read_text(encoding="utf-8"), name, init):
            while not _exists(target):
                target = target.rsplit(".", 1)[0]
            if target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def include_graph() -> dict:
    """{kernel source: the kernels/ sources it #includes}."""
    return {p.name: set(INCLUDE.findall(p.read_text(encoding="utf-8")))
            for p in sorted(KERNELS.iterdir()) if p.suffix in (".cu", ".cuh")}


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}, "b": set()}) == [["a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_import_circle():
    graph = module_graph()
    assert "gptcuda.ops.cuda.layernorm" in graph and "gptcuda.ops.cuda.elementwise" in graph["gptcuda.ops.cuda.layernorm"]
    found = circles(graph)
    assert not found, "modules that import each other (directly or around a circle):\n  " + "\n  ".join(
        " <-> ".join(c) for c in found)


def test_no_include_circle():
    graph = include_graph()
    missing = sorted(f"{f} includes {inc}" for f, incs in graph.items() for inc in incs if inc not in graph)
    assert not missing, f"includes of no kernels/ source: {missing}"
    found = circles(graph)
    assert not found, "kernel sources that include each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_launchers_load_the_kernel_sources():
    """Every file in a VARIANTS list is a .cu of kernels/, and every kernels/*.cu is some launcher's."""
    from gptcuda.ops.cuda_backend import FAMILIES
    loaded = {f for fam in FAMILIES for f, _, _ in fam.VARIANTS}
    sources = {p.name for p in KERNELS.glob("*.cu")}
    assert loaded <= sources, f"launchers load files kernels/ lacks: {sorted(loaded - sources)}"
    assert sources <= loaded, f"kernel sources no launcher loads: {sorted(sources - loaded)}"
