#!/usr/bin/env python3
"""Import circles between modules: in each Rust crate under crates/ (`crate::`, `super::`,
`self::` paths, grouped `use` included, in non-test code; a module's edges to its own ancestors
and descendants are left out, since a parent declares its children and they use its items) and
in python/gpumem_trace (relative imports, function-level ones included). Prints each circle and
exits 1 if there is one. Usage: scripts/import-cycles.py [-v] (-v also prints every edge)."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cycles(edges):
    """The strongly connected components of more than one node (Tarjan), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def rust_module(src, path):
    """A source file's module path: () for lib.rs/main.rs, ("a", "b") for a/b.rs or a/b/mod.rs."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "mod" or (len(parts) == 1 and parts[0] in ("lib", "main")):
        parts = parts[:-1]
    return tuple(parts)


def expand(tree):
    """`a::{b, c::{d, e}}` → ["a::b", "a::c::d", "a::c::e"]."""
    tree = re.sub(r"\s+", "", tree)
    i = tree.find("{")
    if i < 0:
        return [tree]
    prefix, depth, items, start = tree[:i], 0, [], i + 1
    for j in range(i, len(tree)):
        if tree[j] == "{":
            depth += 1
        elif tree[j] == "}":
            depth -= 1
            if depth == 0:
                items.append(tree[start:j])
                break
        elif tree[j] == "," and depth == 1:
            items.append(tree[start:j])
            start = j + 1
    return [p for item in items if item for p in expand(prefix + item)]


def strip(text):
    """Source without comments, string literals and the trailing `#[cfg(test)] mod …` block."""
    text = re.split(r"\n#\[cfg\(test\)\]\s*\n\s*mod \w+\s*\{", text)[0]
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*(?:.|\n)*?\*/", "", text)


def rust_edges(crate):
    src = crate / "src"
    files = {rust_module(src, f): f for f in src.rglob("*.rs")}
    edges = {}
    for module, file in files.items():
        text = strip(file.read_text())
        paths = [p for u in re.findall(r"\buse\s+([^;]+);", text) for p in expand(u)]
        paths += re.findall(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+)", text)
        for path in paths:
            parts = path.split("::")
            if parts[0] == "crate":
                base, rest = (), parts[1:]
            elif parts[0] in ("super", "self"):
                base = module
                while parts and parts[0] in ("super", "self"):
                    base = base[:-1] if parts[0] == "super" else base
                    parts = parts[1:]
                rest = parts
            else:
                continue
            # The longest prefix that is a module file.
            target = base
            for k in range(len(rest), -1, -1):
                if base + tuple(rest[:k]) in files:
                    target = base + tuple(rest[:k])
                    break
            related = target[: len(module)] == module or module[: len(target)] == target
            if not related:
                edges.setdefault(module, set()).add(target)
    return edges


def python_edges(package):
    modules = {f.stem for f in package.glob("*.py")}
    edges = {}
    for f in package.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                if node.module:
                    targets = [node.module.split(".")[0]]
                else:
                    targets = [a.name for a in node.names if a.name in modules] or ["__init__"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                package.name + "."
            ):
                targets = [node.module.split(".")[1]]
            elif isinstance(node, ast.Import):
                targets = [
                    a.name.split(".")[1] for a in node.names if a.name.startswith(package.name + ".")
                ]
            for t in targets:
                if t != f.stem:
                    edges.setdefault(f.stem, set()).add(t)
    return edges


def main():
    verbose = "-v" in sys.argv[1:]
    found = False
    graphs = [
        (f"crates/{c.name}", rust_edges(c))
        for c in sorted((ROOT / "crates").iterdir())
        if (c / "src").is_dir()
    ]
    graphs.append(("python/gpumem_trace", python_edges(ROOT / "python" / "gpumem_trace")))
    for name, edges in graphs:
        show = lambda m: m if isinstance(m, str) else "::".join(("crate",) + m)
        if verbose:
            for a in sorted(edges):
                for b in sorted(edges[a]):
                    print(f"{name}: {show(a)} -> {show(b)}")
        for comp in cycles(edges):
            found = True
            print(f"{name}: import circle: {', '.join(show(m) for m in comp)}")
    if not found:
        print(f"no import circles ({len(graphs)} packages)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
