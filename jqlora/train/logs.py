"""The run's log files in ``out_dir``: per-step CSVs (train loss, eval loss) and the loss plot."""
from __future__ import annotations

import contextlib
import csv
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

CSV_NAME = "loss.csv"
PNG_NAME = "loss.png"
EVAL_CSV_NAME = "eval.csv"


@contextlib.contextmanager
def naming_file(path) -> Iterator[None]:
    """Re-raise an OSError without a file name (ENOSPC from a write()) as one naming `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


class CsvLog:
    """A CSV file of per-step rows, flushed per row; on resume it keeps the rows up to the
    resumed step (rewritten through a temp file and a rename) and drops the rest."""

    def __init__(self, path: Path, header: Sequence[str], keep_upto: int | None):
        self.path = path
        rows: list[list[str]] = []
        if keep_upto is not None and path.is_file():
            with open(path, newline="") as f:
                r = list(csv.reader(f))
            for row in r[1:]:
                try:
                    if int(row[0]) <= keep_upto:
                        rows.append(row)
                except (ValueError, IndexError):
                    continue
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(rows)
        os.replace(tmp, path)
        self._f = open(path, "a", newline="")
        self._w = csv.writer(self._f)

    def write(self, row: Sequence) -> None:
        with naming_file(self.path):
            self._w.writerow(row)
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def _read_csv(path: Path) -> tuple[list[int], list[list[float]]]:
    steps, cols = [], []
    if not path.is_file():
        return steps, cols
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    for row in rows:
        try:
            steps.append(int(row[0]))
            cols.append([float(x) for x in row[1:]])
        except (ValueError, IndexError):
            continue
    return steps, cols


def write_loss_plot(out_dir: Path) -> Path | None:
    """Draw ``loss.png`` (train loss, and eval loss if any) from the CSVs in ``out_dir``."""
    steps, cols = _read_csv(out_dir / CSV_NAME)
    if not steps:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, [c[0] for c in cols], label="train loss", lw=1.2)
    esteps, ecols = _read_csv(out_dir / EVAL_CSV_NAME)
    if esteps:
        ax.plot(esteps, [c[0] for c in ecols], "o-", label="eval loss", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / PNG_NAME
    tmp = out_dir / (PNG_NAME + ".tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, path)
    return path
