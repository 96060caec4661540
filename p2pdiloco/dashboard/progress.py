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
    """Yield a callback that drives one bar; a no-op bar when the console is not a terminal."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    )
    task = progress.add_task("starting", total=None)

    def update(description: str, done: int, total: int) -> None:
        progress.update(task, description=description, completed=done, total=total)

    with progress:
        yield update
