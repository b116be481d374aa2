"""Progress on rank 0: a rich bar (step, loss, samples/s, ETA) on a terminal, plain lines elsewhere."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, *, enabled: bool, console: Console | None = None) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._bar: Progress | None = None
        self._task = None
        self._last_line = 0.0
        if enabled and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._bar.add_task("train", total=total_steps, loss="-", rate="-")
            self._bar.start()

    def update(self, step: int, *, loss: float | None, samples_per_s: float, epoch: int) -> None:
        if not self.enabled:
            return
        loss_text = "-" if loss is None else f"{loss:.4f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss_text, rate=f"{samples_per_s:,.0f}")
            return
        now = time.monotonic()  # no terminal: a plain line at most every 5 s, and at the end
        if step == self.total or now - self._last_line >= 5.0:
            self._last_line = now
            self.console.print(f"step {step}/{self.total} epoch {epoch} loss {loss_text} "
                               f"{samples_per_s:,.0f} samples/s", highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
