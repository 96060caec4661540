"""A progress bar fed by the library's ``(description, done, total)`` callbacks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@contextlib.contextmanager
def progress_bar(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """Yield a callback that drives one bar on a terminal; elsewhere (a pipe, a log file,
    ``simulate --json`` with stderr redirected) each call prints one plain line instead."""
    if not console.is_terminal:

        def line(description: str, done: int, total: int) -> None:
            console.out(f"{description} [{done}/{total} steps]", highlight=False)

        yield line
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    task = progress.add_task("starting", total=None)

    def update(description: str, done: int, total: int) -> None:
        progress.update(task, description=description, completed=done, total=total)

    with progress:
        yield update
