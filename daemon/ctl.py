"""`ulyssesctl`: the operator CLI (filled in by the supervisor and remediation issues)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("usage: ulyssesctl COMMAND\n\nNot implemented yet (issues 5 and 6).")
    return 2


if __name__ == "__main__":
    sys.exit(main())
