"""Build progress: TensorRT's IProgressMonitor phases shown as rich progress bars.

``PhaseBars`` holds the logic (testable without TensorRT); ``make_monitor`` wraps it in a
``trt.IProgressMonitor`` subclass, created only when TensorRT is importable.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class PhaseBars:
    """One bar per active TensorRT build phase, indented under its parent phase."""

    def __init__(self, console: Console | None = None):
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console or Console(stderr=True), transient=True)
        self.tasks: dict[str, Any] = {}
        self.depth: dict[str, int] = {}
        self.finished: list[str] = []
        self.cancelled = False

    def start(self, phase: str, parent: str | None, steps: int) -> None:
        if not self.tasks:
            self.progress.start()
        d = self.depth.get(parent, -1) + 1 if parent else 0
        self.depth[phase] = d
        self.tasks[phase] = self.progress.add_task("  " * d + phase, total=max(steps, 1))

    def step(self, phase: str, step: int) -> bool:
        if phase in self.tasks:
            self.progress.update(self.tasks[phase], completed=step + 1)
        return not self.cancelled

    def finish(self, phase: str) -> None:
        task = self.tasks.pop(phase, None)
        if task is not None:
            self.progress.remove_task(task)
        self.finished.append(phase)
        if not self.tasks:
            self.progress.stop()

    def close(self) -> None:
        """Stop the bars of phases TensorRT left open (a cancelled or failed build need not finish them)."""
        for task in self.tasks.values():
            self.progress.remove_task(task)
        self.tasks.clear()
        self.progress.stop()


def make_monitor(trt: Any, console: Console | None = None) -> Any:
    """A trt.IProgressMonitor that drives PhaseBars (TensorRT ≥ 10.0).

    TensorRT calls these methods from inside build_serialized_network, and its binding swallows whatever they
    raise (printing "[ERROR] Exception caught in step_complete()"). A Ctrl-C or SIGTERM (raised as an interrupt by
    the CLI) that lands in one would vanish into a build that merely "built no engine"; the monitor keeps it in
    ``interrupted``, cancels the build (step_complete answers False), and ``end_build`` re-raises it after."""

    class RichMonitor(trt.IProgressMonitor):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.bars = PhaseBars(console)
            self.interrupted: BaseException | None = None

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            try:
                self.bars.start(phase_name, parent_phase, num_steps)
            except KeyboardInterrupt as e:
                self.interrupted = e

        def step_complete(self, phase_name: str, step: int) -> bool:
            try:
                return self.bars.step(phase_name, step) and self.interrupted is None
            except KeyboardInterrupt as e:
                self.interrupted = e
                return False

        def phase_finish(self, phase_name: str) -> None:
            try:
                self.bars.finish(phase_name)
            except KeyboardInterrupt as e:
                self.interrupted = e

    return RichMonitor()


def end_build(monitor: Any) -> None:
    """After build_serialized_network: stop the bars; re-raise an interrupt that arrived during the build."""
    monitor.bars.close()
    if monitor.interrupted is not None:
        raise monitor.interrupted
