"""How a run's copy progress is shown on stderr: a rich bar (rate, ETA) in a terminal, plain
lines at a steady interval in a log. Sizes are decimal, through :func:`units.format_bytes`."""

from __future__ import annotations

import threading
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from ..api import ReshardProgress
from ..plan.planner import StagePlan
from ..units import format_bytes, plural


class _BytesColumn(ProgressColumn):
    """``done / total`` in the tool's decimal units."""

    def render(self, task: Task) -> Text:
        total = format_bytes(task.total) if task.total is not None else "?"
        return Text(f"{format_bytes(task.completed)} / {total}", style="progress.download")


class _RateColumn(ProgressColumn):
    """Bytes per second in the tool's decimal units."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("?" if speed is None else f"{format_bytes(speed)}/s", style="progress.data.speed")


class RichReporter(ReshardProgress):
    """A byte progress bar (rate, ETA) over all source bytes copied by this run, for a terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.downloads = 0
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            _BytesColumn(),
            _RateColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = None
        self.download_task = None

    def expect_downloads(self, total_bytes: int) -> None:
        """Whole shards this run downloads from the Hub get a row of their own, above the copy."""
        self.downloads = total_bytes

    def start(self, total_bytes: int) -> None:
        if self.downloads:
            self.download_task = self.progress.add_task("downloading", total=self.downloads)
        self.task = self.progress.add_task("source bytes", total=total_bytes)
        self.progress.start()

    def advance(self, nbytes: int) -> None:
        self.progress.advance(self.task, nbytes)

    def fetched(self, nbytes: int) -> None:
        """Bytes of a whole-shard download (huggingface_hub reports them as they arrive)."""
        if self.download_task is not None:
            self.progress.advance(self.download_task, nbytes)

    def stage_copied(self, stage: StagePlan) -> None:
        """The bar shows it; the stage's line comes when it is complete."""

    def stage_done(self, stage: StagePlan) -> None:
        # A stage may finish while later ones copy: its line goes above the bar. Once the copy
        # is over the bar stops, and stays as the last record above the stages finished then.
        if self.task is None or next(t for t in self.progress.tasks if t.id == self.task).finished:
            self.close()
        self.console.print(f"[green]done[/] {_stage_line(stage)}")

    def close(self) -> None:
        if self.progress.live.is_started:
            self.progress.stop()


# Seconds between two progress lines in a log (stderr not a terminal); tests set it shorter.
LOG_INTERVAL_ENV = "QWEN35_RESHARD_PROGRESS_SECONDS"
LOG_INTERVAL = 10.0


class LogReporter(ReshardProgress):
    """Progress for a log (a CI job's, ``2> file``): plain lines, each written whole and flushed
    as it happens: a line every ``interval`` seconds (bytes, rate, time left), each stage's data
    copied, each stage done. No bar, no padding, no wrapping: a log is read, and grepped, later.
    """

    def __init__(self, stream: TextIO, interval: float = LOG_INTERVAL) -> None:
        self.stream = stream
        self.interval = interval
        self.lock = threading.Lock()  # one line at a time, from the ticker and the run's threads
        self.total = self.done = self.downloads = self.downloaded = 0
        self.started = 0.0
        self.stop = threading.Event()
        self.ticker: threading.Thread | None = None

    def say(self, line: str) -> None:
        with self.lock:
            print(line, file=self.stream, flush=True)

    def expect_downloads(self, total_bytes: int) -> None:
        self.downloads = total_bytes

    def start(self, total_bytes: int) -> None:
        self.total, self.started = total_bytes, time.monotonic()
        self.say(f"copying {format_bytes(total_bytes)} of source bytes")
        self.ticker = threading.Thread(target=self._tick, name="progress-log", daemon=True)
        self.ticker.start()

    def advance(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes

    def fetched(self, nbytes: int) -> None:
        with self.lock:
            self.downloaded += nbytes

    def stage_copied(self, stage: StagePlan) -> None:
        files = plural(len(stage.files), "data file")
        self.say(f"copied {stage.dirname}: {files}, {format_bytes(stage.size)}")

    def stage_done(self, stage: StagePlan) -> None:
        with self.lock:
            copying = self.done < self.total  # a stage finished while later ones copy
        if not copying:
            self.close()
        self.say(f"done {_stage_line(stage)}")

    def close(self) -> None:
        """Stop the ticker and say where the copy ended, once."""
        if self.ticker is None:
            return
        self.stop.set()
        self.ticker.join()
        self.ticker = None
        self.say(self.line())

    def _tick(self) -> None:
        while not self.stop.wait(self.interval):
            self.say(self.line())

    def line(self) -> str:
        """``progress: DONE of TOTAL (P%), RATE/s, T left`` (and the download, while there is one)."""
        with self.lock:
            done, downloaded = self.done, self.downloaded
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = done / elapsed
        left = f"{_clock((self.total - done) / rate)} left" if rate > 0 else "time left unknown"
        pct = 100 * done / max(self.total, 1)
        line = (
            f"progress: {format_bytes(done)} of {format_bytes(self.total)} ({pct:.0f}%), "
            f"{format_bytes(rate)}/s, {left}, {_clock(elapsed)} elapsed"
        )
        if self.downloads:
            line += f"; downloaded {format_bytes(downloaded)} of {format_bytes(self.downloads)}"
        return line


def _clock(seconds: float) -> str:
    """``H:MM:SS``, as the bar shows time."""
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _stage_line(stage: StagePlan) -> str:
    return f"{stage.dirname}: {plural(len(stage.tensors), 'tensor')}, {format_bytes(stage.size)}"
