"""`ulysses-train` / `python -m ulyssesd.training` (filled in by the training issue)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("usage: ulysses-train --spec RUN.toml --run-dir DIR\n\nNot implemented yet (issue 3).")
    return 2


if __name__ == "__main__":
    sys.exit(main())
