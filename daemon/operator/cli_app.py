"""The one CLI framework of every ulyssesd executable (`ulyssesd`, `ulyssesctl` and its commands): Typer
apps built here, so all of them parse, exit and render help the same way.

Help is rendered by Typer's plain (click-style) formatter, not its rich one: rich reads `[checkpoint]` in a
help text as markup and drops it, and the rich panels label every flag `<bool>`. Plain help keeps brackets,
shows flags bare and `<int>`/`<path>` only where a value is expected. `-h` works like `--help`.
"""

from __future__ import annotations

from typing import Any

import typer

#: Context settings every command shares.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def cli_app(help_text: str, **kwargs: Any) -> typer.Typer:
    """A Typer app (or sub-app) with the shared settings: plain help, no shell-completion options, no
    pretty tracebacks (an unexpected error prints Python's own), help when called without a command."""
    return typer.Typer(help=help_text, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                       pretty_exceptions_enable=False, context_settings=CONTEXT_SETTINGS, **kwargs)


def exit_code_of(exc: SystemExit) -> int:
    """The integer exit status a Typer app's SystemExit carries (None -> 0, a message -> 2)."""
    code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 2)
