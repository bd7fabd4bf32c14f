"""Write the docstrings of the Python standard library as a JSONL corpus (one document per module).

    python examples/stdlib_text/make_corpus.py OUT.jsonl [--max-mb 2]

Real English technical prose that ships with every Python installation, so the example trains on real
text without downloading anything. The sources are parsed with `ast` (nothing is imported or run); test
suites and vendored packages are left out; modules are taken in sorted path order until --max-mb.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

_EXCLUDE = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo")


def module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                docs.append(doc)
    return "\n\n".join(docs)


def corpus(max_bytes: int) -> list[dict[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if any(part in _EXCLUDE for part in path.relative_to(root).parts):
            continue
        text = module_docstrings(path)
        if not text:
            continue
        out.append({"text": text, "module": str(path.relative_to(root))})
        total += len(text.encode())
        if total >= max_bytes:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--max-mb", type=float, default=2.0, help="stop after this much text (default 2 MB)")
    args = ap.parse_args(argv)
    docs = corpus(int(args.max_mb * 1e6))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps(d) + "\n")
    size = sum(len(d["text"].encode()) for d in docs)
    print(f"wrote {len(docs)} modules, {size / 1e6:.2f} MB of docstrings to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
