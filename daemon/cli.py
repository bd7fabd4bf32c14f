"""`ulyssesd`: the supervisor daemon's entry point (filled in by the supervisor issue)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("usage: ulyssesd [run --spec RUN.toml | demo]\n\nThe supervisor is not implemented yet (issue 6).")
    return 2


if __name__ == "__main__":
    sys.exit(main())
