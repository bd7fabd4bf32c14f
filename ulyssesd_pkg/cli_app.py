"""The one CLI framework of every ulyssesd executable: `ulyssesd`, `ulyssesctl` (daemon side) and the job's
`ulysses-train` and `ulysses-preprocess` (training side). Typer apps built here, so all of them parse, exit
and render help the same way. It lives at the package's top (`ulyssesd.cli_app`), imports only Typer, and
so both sides may use it: the job never imports the daemon package, operator hosts have no torch.

Help is rendered by Typer's plain (click-style) formatter, not its rich one: rich reads `[checkpoint]` in a
help text as markup and drops it, and the rich panels label every flag `<bool>`. Plain help keeps brackets,
shows flags bare and `<int>`/`<path>` only where a value is expected. `-h` works like `--help`. A usage
error (unknown flag, missing value) exits 2, as argparse did.
"""

from __future__ import annotations

from typing import Any

import typer

#: Context settings every command shares.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def cli_app(help_text: str, **kwargs: Any) -> typer.Typer:
    """A Typer app (or sub-app) with the shared settings: plain help, no shell-completion options, no
    pretty tracebacks (an unexpected error prints Python's own), help when called without a command (a
    single-command app whose flags are all optional passes `no_args_is_help=False`)."""
    settings: dict[str, Any] = {"add_completion": False, "no_args_is_help": True, "rich_markup_mode": None,
                                "pretty_exceptions_enable": False, "context_settings": CONTEXT_SETTINGS}
    return typer.Typer(help=help_text, **{**settings, **kwargs})


def exit_code_of(exc: SystemExit) -> int:
    """The integer exit status a Typer app's SystemExit carries (None -> 0, a message -> 2)."""
    code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 2)


def run_cli(app: typer.Typer, argv: list[str] | None, prog_name: str) -> int:
    """Run `app` on `argv` (None: sys.argv) and return its exit status instead of exiting: commands end with
    `raise typer.Exit(code)`; help is 0, a usage error 2."""
    try:
        app(args=argv, prog_name=prog_name)
    except SystemExit as exc:
        return exit_code_of(exc)
    return 0
