"""The installed package's version, shared by `ulyssesd --version` and `ulyssesctl --version`."""

from __future__ import annotations

DIST_NAME = "ulyssesd"


def package_version() -> str:
    """The version pip recorded for the `ulyssesd` distribution (importlib.metadata). A source tree that was
    never installed has no such record: say so rather than guess a number."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DIST_NAME)
    except PackageNotFoundError:
        return "unknown (the ulyssesd package is not installed)"


def version_line(prog: str) -> str:
    """`PROG VERSION`, the line both executables print for --version."""
    return f"{prog} {package_version()}"
