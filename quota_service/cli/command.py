"""What each command module gives the parser: its subcommands, each with the function that runs
it (set as the parser's default `run`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from quota_service.config import Settings

# A subcommand's entry point: its exit status.
Run = Callable[[argparse.Namespace, Settings], int]
# The `add_parser` of `kvquota`'s subcommands (or of a command group's).
AddParser = Callable[..., argparse.ArgumentParser]


def add_json_option(parser: argparse.ArgumentParser, what: str = "a table") -> None:
    parser.add_argument("--json", action="store_true", help=f"print JSON instead of {what}")
