"""The one CLI framework of every ulyssesd executable: `ulyssesd`, `ulyssesctl` (daemon side) and the job's
`ulysses-train` and `ulysses-preprocess` (training side). Typer apps built here, so all of them parse, exit
and render help the same way. It lives at the package's top (`ulyssesd.cli_app`), imports only Typer, and
so both sides may use it: the job never imports the daemon package, operator hosts have no torch.

Help is rendered by Typer's plain (click-style) formatter, not its rich one: rich reads `[checkpoint]` in a
help text as markup and drops it, and the rich panels label every flag `<bool>`. Plain help keeps brackets,
shows flags bare and `<int>`/`<path>` only where a value is expected. `-h` works like `--help`. A usage
error (unknown flag, missing value, bad value) exits 2, as argparse did; under `--json` (`run_cli(...,
json_errors=True)`) it is one JSON object on stdout, `{"ok": false, "error": ..., "exit_code": 2, "usage": ...}`,
the shape of ulyssesctl's other --json errors, so a script parsing stdout gets JSON whatever went wrong.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import typer
from typer.core import TyperCommand

#: The base class of Click's usage errors (unknown option, missing argument, bad value), found through Typer's
#: public BadParameter: Typer ≥ 0.2x vendors Click (typer._click), older Typers raise click's own.
CLICK_EXCEPTION: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

#: Context settings every command shares.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


#: A usage-line piece in braces: how Typer ≥ 0.2x writes a required argument (`{ID}`, `{INPUT}...`).
_BRACED_PIECE = re.compile(r"\{([^{}]+)\}((?:\.\.\.)?)")


class PlainUsageCommand(TyperCommand):
    """A command whose usage line writes a required argument as `ID`, the way click and argparse do: Typer
    writes `{ID}`, which reads as a template placeholder left unfilled. Optional ones stay `[RUN]`."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [_BRACED_PIECE.sub(r"\1\2", piece) for piece in super().collect_usage_pieces(ctx)]


class _App(typer.Typer):
    """typer.Typer whose commands are PlainUsageCommand unless a command asks for another class."""

    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["cls"] = kwargs.get("cls") or PlainUsageCommand
        return super().command(*args, **kwargs)


def cli_app(help_text: str, **kwargs: Any) -> typer.Typer:
    """A Typer app (or sub-app) with the shared settings: plain help, no shell-completion options, no
    pretty tracebacks (an unexpected error prints Python's own), help when called without a command (a
    single-command app whose flags are all optional passes `no_args_is_help=False`), required arguments
    written plainly on the usage line (PlainUsageCommand)."""
    settings: dict[str, Any] = {"add_completion": False, "no_args_is_help": True, "rich_markup_mode": None,
                                "pretty_exceptions_enable": False, "context_settings": CONTEXT_SETTINGS}
    return _App(help=help_text, **{**settings, **kwargs})


def exit_code_of(exc: SystemExit) -> int:
    """The integer exit status a Typer app's SystemExit carries (None -> 0, a message -> 2)."""
    code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 2)


def run_cli(app: typer.Typer, argv: list[str] | None, prog_name: str, *, json_errors: bool = False) -> int:
    """Run `app` on `argv` (None: sys.argv) and return its exit status instead of exiting: commands end with
    `raise typer.Exit(code)`; help is 0, a usage error 2. With `json_errors` a usage error prints
    `usage_error_json` on stdout instead of the usage text on stderr (same exit code)."""
    try:
        if not json_errors:
            app(args=argv, prog_name=prog_name)
            return 0
        # Not standalone: click hands the usage error back instead of printing it and exiting.
        result = app(args=argv, prog_name=prog_name, standalone_mode=False)
    except SystemExit as exc:
        return exit_code_of(exc)
    except CLICK_EXCEPTION as exc:
        sys.stdout.write(usage_error_json(exc) + "\n")
        return int(getattr(exc, "exit_code", 2))
    except typer.Abort:  # what standalone mode prints for an aborted prompt (EOF on stdin)
        sys.stderr.write("Aborted!\n")
        return 1
    return result if isinstance(result, int) else 0


def usage_error_json(exc: Exception) -> str:
    """A Click usage error as one JSON object: what is wrong (Click's own message, e.g. "No such option:
    --bogus"), the exit code, and the usage line of the command it concerns (null when Click did not get
    that far)."""
    ctx = getattr(exc, "ctx", None)
    usage = ctx.get_usage() if ctx is not None else None
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    return json.dumps({"ok": False, "error": message, "exit_code": int(getattr(exc, "exit_code", 2)),
                       "usage": usage})


def wants_json(argv: list[str] | None) -> bool:
    """Whether this command line asks for --json output (None: sys.argv), before it is parsed: also a command
    line that does not parse asks for its error as JSON."""
    return "--json" in (argv if argv is not None else sys.argv[1:])
