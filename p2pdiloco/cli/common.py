"""What every command shares: the one-line error contract and logging setup."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from p2pdiloco.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])

# Exit code for bad input from the user (usage errors use typer's own code 2 as well).
EXIT_USER_ERROR = 2


def user_errors(fn: F) -> F:
    """Turn a UserError (and friends) into ``error: <message>`` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # transformers is chatty about generation configs and weight init; keep our output readable.
    logging.getLogger("transformers").setLevel(logging.ERROR)
