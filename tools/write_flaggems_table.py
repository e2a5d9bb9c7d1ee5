"""Print FlagGems' registration table (`_FULL_CONFIG` in flag_gems/__init__.py) as (ATen key, function name) pairs,
read from the source without importing it (flag_gems does not import without a GPU: "No device were detected").

    python tools/write_flaggems_table.py /path/to/site-packages/flag_gems > deepinfer/debug/flaggems_table.py

The function name is what `only_enable(include=[...])` matches (FlagGems 5.0.2 looks names up in
FULL_CONFIG_BY_FUNC, keyed by each function's __name__): the `def` a table symbol is bound to, found by name in the
package's sources (a symbol bound by assignment keeps the name of the def it aliases, which we do not chase; the
test compares this copy with the real source where the package is extracted).
"""

from __future__ import annotations

import ast
import os
import sys


def read_table(pkg: str) -> list[tuple[str, str, bool]]:
    """[(key, symbol, conditional)] in table order."""
    tree = ast.parse(open(os.path.join(pkg, "__init__.py"), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_FULL_CONFIG" for t in node.targets):
            out = []
            for e in node.value.elts:
                key, sym = e.elts[0].value, e.elts[1].id
                out.append((key, sym, len(e.elts) > 2))
            return out
    raise SystemExit(f"no _FULL_CONFIG in {pkg}/__init__.py")


def def_names(pkg: str) -> set[str]:
    names = set()
    for dp, _, fs in os.walk(pkg):
        for f in fs:
            if f.endswith(".py"):
                try:
                    tree = ast.parse(open(os.path.join(dp, f), encoding="utf-8").read())
                except (SyntaxError, UnicodeDecodeError):
                    continue
                names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return names


def main(pkg: str) -> None:
    table, defs = read_table(pkg), def_names(pkg)
    ver = "?"
    for line in open(os.path.join(pkg, "__init__.py"), encoding="utf-8"):
        if line.startswith("__version__"):
            ver = line.split("=")[1].strip().strip('"\'')
    print(f'"""FlagGems {ver}\'s registration table, copied from flag_gems/__init__.py `_FULL_CONFIG` by')
    print("tools/write_flaggems_table.py (flag_gems does not import without a GPU). Each entry: (ATen key as registered,")
    print("the registered function's name -- what only_enable(include=...) matches --, conditional on the torch")
    print('version). Used where flag_gems cannot be imported (CPU tests, planning); the screen uses the real table."""')
    print()
    print(f'VERSION = "{ver}"')
    print()
    print("FULL_CONFIG: tuple[tuple[str, str, bool], ...] = (")
    for key, sym, cond in table:
        if sym not in defs:
            print(f"    # {sym}: no def of that name in the sources (an alias); its __name__ is assumed to be {sym}")
        print(f"    ({key!r}, {sym!r}, {cond}),")
    print(")")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/site-local/flag_gems")
