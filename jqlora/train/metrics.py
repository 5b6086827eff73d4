"""Where a run's metrics go, all in ``out_dir``: ``loss.csv`` / ``eval.csv`` rows, the ``loss.png``
plot drawn from them, TensorBoard scalars and the progress on stderr (a tqdm bar on a terminal,
plain lines in a log file). :func:`jqlora.train.train` hands each finished step and each evaluation
to one :class:`MetricsLog` and draws the plot with :func:`write_loss_plot`.

``loss.csv`` has a row at step 1, every ``log_every``-th step and the last step; its ``loss`` is
the mean of the steps' losses since the previous row (so a row at step 20 with ``log_every`` 10
averages steps 11-20, across a resume: checkpoints keep the window's sums), its ``lr`` and ``grad_norm`` are the row's step's, its ``tokens_per_s`` the
window's rate.

TensorBoard: event files in ``<out_dir>/tensorboard/`` (scalars ``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s`` at the steps ``loss.csv`` logs, with the same values;
``eval/loss`` and ``eval/perplexity`` at the steps ``eval.csv`` logs), written with tensorboardX.
Each :func:`train` call writes its own file, starting with a session-start record at its first
step: TensorBoard then hides the steps from there on that earlier files hold (an interrupted run's
steps after the checkpoint it resumed from, or a removed run's), as ``loss.csv`` drops its rows.
"""
from __future__ import annotations

import contextlib
import csv
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["MetricsLog", "EventFile", "CsvLog", "write_loss_plot", "naming_file", "perplexity",
           "CSV_NAME", "EVAL_CSV_NAME", "PNG_NAME", "TB_DIR", "TRAIN_COLUMNS", "EVAL_COLUMNS"]

CSV_NAME = "loss.csv"
PNG_NAME = "loss.png"
EVAL_CSV_NAME = "eval.csv"
TB_DIR = "tensorboard"
TRAIN_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "grad_norm")
EVAL_COLUMNS = ("step", "eval_loss", "perplexity")


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


def perplexity(mean_loss: float) -> float:
    """exp of a mean cross-entropy (inf past float range, NaN for NaN)."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf


def _import_tensorboardx():
    """tensorboardX's event writer and protos. tensorboardX imports torch whenever torch is
    installed (about 1.5 s, and CUDA libraries beside jax's on a GPU machine), for tensor types
    that scalars never need: the import runs with torch hidden unless torch is already loaded."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
    try:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2, summary_pb2
    finally:
        if hide:
            del sys.modules["torch"]
    return EventsWriter, event_pb2, summary_pb2


class EventFile:
    """One TensorBoard event file in ``logdir``, written synchronously (tensorboardX's
    ``EventsWriter``: the TFRecord framing with CRCs) and flushed per call like the CSVs, so that
    a full disk fails the step that wrote, naming the file. ``first_step``: the session-start
    record (see the module docstring)."""

    def __init__(self, logdir: Path, first_step: int):
        writer_cls, self._event_pb2, self._summary_pb2 = _import_tensorboardx()
        logdir.mkdir(parents=True, exist_ok=True)
        # the name holds the time in seconds, then this: TensorBoard reads the files in name
        # order, so that a resumed call's file comes after the interrupted one's in the same second
        self._writer = writer_cls(str(logdir / "events"), f".step{first_step:08d}.{os.getpid()}")
        self.path = Path(getattr(self._writer, "_file_name", logdir))
        ev = self._event_pb2
        self._write(ev.Event(wall_time=time.time(), step=first_step,
                             session_log=ev.SessionLog(status=ev.SessionLog.START)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        s = self._summary_pb2.Summary
        summary = s(value=[s.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self._write(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event) -> None:
        with naming_file(self.path):
            self._writer.write_event(event)
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLog:
    """The metrics of one :func:`jqlora.train.train` call, from step ``start + 1`` to ``total``.

    Tokens/s: per step (the bar, :attr:`TrainResult.tokens_per_s`), over the steps since the last
    CSV row (``loss.csv``, TensorBoard) and since the last plain line; time spent in
    :meth:`paused` (evaluation, checkpoints) counts in none of them."""

    def __init__(self, out_dir: Path, *, start: int, total: int, resumed: bool, log_every: int,
                 evaluating: bool, tensorboard: bool, progress: bool | None,
                 progress_every_s: float, columns: Sequence[str] = (),
                 eval_columns: Sequence[str] | None = None, shown: Sequence[str] = ()):
        # columns: an objective's metrics after TRAIN_COLUMNS (train/<name> in TensorBoard; per
        # row the mean over the steps since the row before, as the loss);
        # eval_columns: its eval.csv columns after "step" (see evaluation_metrics); shown: those
        # of `columns` the bar and the plain lines print
        keep = start if resumed else None
        self.total, self.start, self.log_every = total, start, log_every
        self._columns, self._shown = tuple(columns), tuple(shown)
        self._window_cols: dict[str, float] = {}
        self._eval_columns = tuple(eval_columns or ())
        self._csv = CsvLog(out_dir / CSV_NAME, TRAIN_COLUMNS + self._columns, keep_upto=keep)
        eval_header = EVAL_COLUMNS if eval_columns is None else ("step", *eval_columns)
        self._eval_csv = (CsvLog(out_dir / EVAL_CSV_NAME, eval_header, keep_upto=keep)
                          if evaluating else None)
        self._tb_dir = out_dir / TB_DIR if tensorboard else None
        self._tb: EventFile | None = None  # opened at the first scalar: a call with no step writes none
        tty = sys.stderr.isatty()
        self._plain = progress is None and not tty  # a log file: periodic plain lines, no bar
        self._every_s = progress_every_s
        from tqdm import tqdm

        self._bar = tqdm(total=total, initial=start, disable=not (tty if progress is None else progress),
                         desc="train", dynamic_ncols=True, file=sys.stderr)
        self._t_start = time.perf_counter()
        self.start_clock()
        self._window_tokens = self._line_tokens = 0
        self._window_loss, self._window_steps = 0.0, 0  # loss.csv's mean since its previous row

    def window_state(self) -> dict:
        """The losses (and objective metrics) summed since the last ``loss.csv`` row: a checkpoint
        keeps them, so the first row after a resume averages the same steps as without one."""
        return {"loss": self._window_loss, "steps": self._window_steps, "columns": dict(self._window_cols)}

    def restore_window(self, state: dict | None) -> None:
        """Continue the window a checkpoint's :meth:`window_state` left (None: a fresh one)."""
        if state:
            self._window_loss = float(state.get("loss", 0.0))
            self._window_steps = int(state.get("steps", 0))
            self._window_cols = {str(k): float(v) for k, v in (state.get("columns") or {}).items()}

    def start_clock(self) -> None:
        """Time the next step from now (once its batch is ready and the step is about to go)."""
        self._t_prev = self._window_t0 = self._line_t0 = time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside out of every tokens/s."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            d = time.perf_counter() - t0
            self._t_prev += d
            self._window_t0 += d
            self._line_t0 += d

    def logs_at(self, step: int) -> bool:
        """Whether ``loss.csv`` (and TensorBoard) get a row at ``step``: step 1, every
        ``log_every``-th step and the last one."""
        return step == 1 or step % self.log_every == 0 or step == self.total

    def step(self, step: int, m: dict, tokens: int) -> float:
        """Record a finished step (``m``: loss, lr, grad_norm); returns its tokens/s. A
        ``loss.csv`` row's loss is the mean over the steps since the row before (this call's
        first step, for the first row); lr and grad_norm are the row's step's."""
        now = time.perf_counter()
        tps = tokens / max(now - self._t_prev, 1e-9)
        self._t_prev = now
        self._window_tokens += tokens
        self._line_tokens += tokens
        self._window_loss += float(m["loss"])
        self._window_steps += 1
        for c in self._columns:  # an objective's metrics: means over the window, as the loss
            self._window_cols[c] = self._window_cols.get(c, 0.0) + float(m[c])
        if self.logs_at(step):
            rate = f"{self._window_tokens / max(now - self._window_t0, 1e-9):.2f}"
            loss = self._window_loss / self._window_steps
            cols = {c: self._window_cols[c] / self._window_steps for c in self._columns}
            self._csv.write([step, repr(loss), repr(m["lr"]), rate, repr(m["grad_norm"])]
                            + [repr(cols[c]) for c in self._columns])
            self._window_loss, self._window_steps, self._window_cols = 0.0, 0, {}
            self._scalars(step, {"train/loss": loss, "train/lr": m["lr"],
                                 "train/grad_norm": m["grad_norm"], "train/tokens_per_s": float(rate),
                                 **{f"train/{c}": cols[c] for c in self._columns}})
            self._window_tokens, self._window_t0 = 0, now
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{m['loss']:.4f}", grad_norm=f"{m['grad_norm']:.3g}",
                              tok_s=f"{tps:,.0f}", lr=f"{m['lr']:.2e}",
                              **{c: f"{m[c]:.4g}" for c in self._shown})
        if self._plain and (step == self.start + 1 or step == self.total
                            or now - self._line_t0 >= self._every_s):
            s = int(now - self._t_start)
            print(f"train: step {step}/{self.total}  loss {m['loss']:.4f}  "
                  f"grad_norm {m['grad_norm']:.4g}  lr {m['lr']:.2e}  "
                  + "".join(f"{c} {m[c]:.4g}  " for c in self._shown) +
                  f"tokens/s {self._line_tokens / max(now - self._line_t0, 1e-9):,.0f}  "
                  f"elapsed {s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}", file=sys.stderr, flush=True)
            self._line_t0, self._line_tokens = now, 0
        return tps

    def evaluation(self, step: int, loss: float) -> float:
        """Record an evaluation's mean loss; returns its perplexity."""
        ppl = perplexity(loss)
        self._eval_csv.write([step, repr(loss), repr(ppl)])
        self._scalars(step, {"eval/loss": loss, "eval/perplexity": ppl})
        return ppl

    def evaluation_metrics(self, step: int, metrics: dict) -> None:
        """Record an objective's evaluation: ``metrics`` has the ``eval_columns`` given at
        construction (eval.csv; ``eval/<name>`` in TensorBoard)."""
        self._eval_csv.write([step] + [repr(float(metrics[c])) for c in self._eval_columns])
        self._scalars(step, {f"eval/{c}": metrics[c] for c in self._eval_columns})

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        if self._tb_dir is None:
            return
        if self._tb is None:
            self._tb = EventFile(self._tb_dir, self.start + 1)
        self._tb.scalars(step, values)

    def close(self) -> None:
        with contextlib.ExitStack() as closing:  # every one closed, even when one fails
            for part in (self._bar, self._csv, self._eval_csv, self._tb):
                if part is not None:
                    closing.callback(part.close)
