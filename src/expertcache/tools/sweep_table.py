"""The sweep's results table: its columns, and the files that hold it (CSV, JSON, Parquet), resumable.

A row is one cell: (trace, policy, seed, order, capacity[, miss path, predictor, window, link]) and its
counts. Rows reach the file as cells finish: a ``.csv`` is its own journal (rows appended and flushed);
a ``.json`` or ``.parquet`` file cannot be appended to, so rows go to ``FILE.partial`` (JSON lines)
and the file is written whole at the end, the journal then removed. A resumed sweep reads both back and
computes only the cells they lack; the final file is written in the grid's order either way, so an
interrupted and resumed sweep ends with the same table as one that ran through.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

from expertcache.errors import ExpertcacheError, first_line

# (name, kind): kinds "str" (never empty: "" is a value), "str?" ("" reads as None), "int", "float",
# "bool" (numbers and booleans may be None: "" in CSV, null in JSON).
COUNT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("trace", "str"),
    ("trace_sha", "str"),
    ("policy", "str"),
    ("params", "str"),
    ("seed", "int"),
    ("order", "str"),
    ("capacity", "int"),
    ("share", "float"),
    ("requests", "int"),
    ("misses", "int"),
    ("miss_ratio", "float"),
    ("opt_misses", "int"),
    ("ratio_to_opt", "float"),
    ("opt_is_bound", "bool"),
)
TIMING_COLUMNS: tuple[tuple[str, str], ...] = (
    ("miss", "str?"),
    ("prefetch", "str?"),
    ("window", "int"),
    ("link_bandwidth_gb_s", "float"),
    ("link_latency_us", "float"),
    ("ttft_ms", "float"),
    ("tpot_ms", "float"),
    ("stall_s", "float"),
    ("total_s", "float"),
    ("tokens_per_s", "float"),
    ("bytes_moved", "int"),
    ("transfers", "int"),
)
# What makes a cell the cell it is (a resumed sweep skips a cell whose identity is in the file). The
# trace is known by its content (trace_sha), not its path.
COUNT_IDENTITY = ("trace_sha", "policy", "params", "seed", "order", "capacity")
TIMING_IDENTITY = ("miss", "prefetch", "window", "link_bandwidth_gb_s", "link_latency_us")
FORMATS = (".csv", ".json", ".parquet")
PARQUET_HINT = "pip install pyarrow (or: pip install 'expertcache[sweep]')"


def columns(timing: bool) -> tuple[tuple[str, str], ...]:
    """The table's columns, in their order: the counts, then the timing model's when the grid has it."""
    return COUNT_COLUMNS + (TIMING_COLUMNS if timing else ())


def identity_columns(timing: bool) -> tuple[str, ...]:
    return COUNT_IDENTITY + (TIMING_IDENTITY if timing else ())


def identity(row: dict[str, object], timing: bool) -> tuple[object, ...]:
    return tuple(row[c] for c in identity_columns(timing))


def write_csv(
    rows: Iterable[dict[str, object]], cols: Sequence[str], out: IO[str], header: bool = True
) -> None:
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(cols)
    for row in rows:
        writer.writerow(["" if row[c] is None else row[c] for c in cols])


def to_json(rows: Sequence[dict[str, object]]) -> str:
    return json.dumps(list(rows))


class Results:
    """The results file of a sweep: checked before the work, appended to as cells finish, read back to
    resume, written whole in the grid's order at the end."""

    def __init__(self, path: str | Path, timing: bool) -> None:
        self.path = Path(path)
        self.kind = self.path.suffix.lower()
        self.cols = columns(timing)
        self.names = [name for name, _ in self.cols]
        if self.kind not in FORMATS:
            raise ExpertcacheError(f"{path}: a results file is .csv, .json or .parquet (by its suffix)")
        if self.kind == ".parquet":
            _pyarrow(path)
        self.journal = self.path if self.kind == ".csv" else Path(f"{self.path}.partial")
        self.read_from: dict[tuple[object, ...], Path] = {}  # a resumed row's identity -> its file
        self._out: IO[str] | None = None

    def existing(self) -> list[Path]:
        """The files a run before this one left that hold rows (an empty file, or a CSV of its header alone,
        which a sweep that failed before its first row leaves, holds nothing to lose)."""
        paths = dict.fromkeys((self.path, self.journal))
        return [p for p in paths if p.is_file() and not self._nothing_in(p)]

    def _nothing_in(self, path: Path) -> bool:
        """An empty file, or a CSV holding this table's header (or the start of it) and nothing else."""
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ExpertcacheError(f"{path}: cannot read the results ({e.strerror or e})") from None
        if not data:
            return True
        header = (",".join(self.names) + "\n").encode()
        return path.suffix.lower() == ".csv" and header.startswith(data)

    def start(self, resume: bool, force: bool) -> list[dict[str, object]]:
        """Rows already there (with ``resume``), the journal opened for appending. Existing results are
        resumed or, with ``force``, replaced; without either they are refused, not overwritten."""
        there = self.existing()
        if there and not (resume or force):
            raise ExpertcacheError(
                f"{there[0]}: results exist; --resume (resume=True) to go on from them, or --force "
                "(force=True) to replace them"
            )
        rows: list[dict[str, object]] = []
        if resume:
            timing = len(self.cols) > len(COUNT_COLUMNS)
            for path in there:
                read = self._read(path)
                self.read_from.update((identity(r, timing), path) for r in read)
                rows += read
            if self.journal in there:  # every file read as this sweep's: appending goes on after the
                _cut_to_whole_lines(self.journal)  # last whole line (a killed sweep's cut one dropped)
        else:
            for path in there:
                path.unlink()
        fresh = self.kind == ".csv" and not rows  # a CSV journal starts with its header
        try:
            self._out = open(self.journal, "w" if fresh else "a", encoding="utf-8", newline="")  # noqa: SIM115
            if fresh:
                write_csv([], self.names, self._out)
                self._out.flush()
        except OSError as e:
            raise ExpertcacheError(f"{self.journal}: cannot write the results ({e.strerror or e})") from None
        return _unique(rows, self)

    def append(self, rows: Sequence[dict[str, object]]) -> None:
        """Rows of a finished cell, on disk at once (an interrupted sweep loses no finished cell)."""
        assert self._out is not None
        if self.kind == ".csv":
            write_csv(rows, self.names, self._out, header=False)
        else:
            self._out.writelines(json.dumps(r) + "\n" for r in rows)
        self._out.flush()

    def finish(self, rows: Sequence[dict[str, object]]) -> None:
        """The whole table, in its final order, replacing the journal."""
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            if self.kind == ".parquet":
                pa, pq = _pyarrow(self.path)
                types = {"str": pa.string(), "str?": pa.string(), "int": pa.int64(), "float": pa.float64(),
                         "bool": pa.bool_()}  # fmt: skip
                schema = pa.schema([(name, types[kind]) for name, kind in self.cols])
                pq.write_table(pa.Table.from_pylist(list(rows), schema=schema), tmp)
            else:
                with open(tmp, "w", encoding="utf-8", newline="") as f:
                    if self.kind == ".csv":
                        write_csv(rows, self.names, f)
                    else:
                        f.write(json.dumps(list(rows), indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            raise ExpertcacheError(f"{self.path}: cannot write the results ({e.strerror or e})") from None
        if self.journal != self.path:
            self.journal.unlink(missing_ok=True)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    # -- reading back ----------------------------------------------------------------------------
    def _read(self, path: Path) -> list[dict[str, object]]:
        if path.suffix.lower() == ".parquet":
            return self._typed(path, self._parquet_rows(path), 1)
        if path == self.journal and self.kind != ".csv":  # JSON lines
            lines = _complete_lines(path)
            rows = []
            for i, line in enumerate(lines, 1):
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ExpertcacheError(f"{path}: line {i} is not JSON ({first_line(e)})") from None
            return self._typed(path, rows, 1)
        if path.suffix.lower() == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ExpertcacheError(f"{path}: cannot read the results ({first_line(e)})") from None
            if not isinstance(data, list):
                raise ExpertcacheError(f"{path}: results are a JSON array of rows")
            return self._typed(path, data, 1)
        return self._csv_rows(path)

    def _csv_rows(self, path: Path) -> list[dict[str, object]]:
        lines = _complete_lines(path)
        reader = csv.reader(io.StringIO("\n".join(lines)))
        header = next(reader, None)
        if header != self.names:
            raise ExpertcacheError(_other_columns(path, header or [], self.names))
        rows = []
        for i, fields in enumerate(reader, 2):
            if len(fields) != len(self.names):
                raise ExpertcacheError(f"{path}: line {i} has {len(fields)} fields, the header {len(header)}")
            rows.append(dict(zip(self.names, fields, strict=True)))
        return self._typed(path, rows, 2)

    def _parquet_rows(self, path: Path) -> list[dict[str, object]]:
        _, pq = _pyarrow(path)
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises its own types for a file that is not Parquet
            raise ExpertcacheError(f"{path}: cannot read the results ({first_line(e)})") from None
        return table.to_pylist()

    def _typed(self, path: Path, rows: list[object], first: int) -> list[dict[str, object]]:
        out = []
        for i, row in enumerate(rows, first):
            if not isinstance(row, dict) or list(row) != self.names:
                got = list(row) if isinstance(row, dict) else []
                raise ExpertcacheError(_other_columns(path, got, self.names, f"row {i}"))
            typed = {}
            for name, kind in self.cols:
                try:
                    typed[name] = _value(row[name], kind)
                except (TypeError, ValueError):  # Python's "invalid literal for int()" named no column
                    what = {"int": "a whole number", "float": "a number", "bool": "true or false"}.get(
                        kind.rstrip("?"), kind
                    )
                    raise ExpertcacheError(
                        f"{path}: row {i}, column {name}: {row[name]!r} is not {what}"
                    ) from None
            out.append(typed)
        return out


def _value(v: object, kind: str) -> object:
    """A cell's value from CSV text or JSON, as the sweep writes it."""
    if kind == "str":
        if not isinstance(v, str):
            raise ValueError(f"{v!r} is not text")
        return v
    if v is None or v == "":
        return None
    if kind == "str?":
        return str(v)
    if kind == "bool":
        if isinstance(v, bool):
            return v
        if v in ("True", "False"):
            return v == "True"
        raise ValueError(f"{v!r} is not True or False")
    if kind == "int":
        if isinstance(v, float | bool):
            raise ValueError(f"{v!r} is not an integer")
        return int(v)  # type: ignore[arg-type]
    return float(v)  # type: ignore[arg-type]


def _complete_lines(path: Path) -> list[str]:
    """The file's lines but a last one cut short (a sweep killed while writing it). The file is left as
    it is: only once it reads as this sweep's is it cut back (``_cut_to_whole_lines``)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ExpertcacheError(f"{path}: cannot read the results ({e.strerror or e})") from None
    whole = data[: data.rfind(b"\n") + 1]
    try:
        return whole.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ExpertcacheError(f"{path}: not a results file (not UTF-8 text)") from None


def _cut_to_whole_lines(path: Path) -> None:
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole != len(data):
        with open(path, "r+b") as f:
            f.truncate(whole)


def _other_columns(path: Path, got: Sequence[str], want: Sequence[str], where: str = "its header") -> str:
    missing = [c for c in want if c not in got]
    extra = [c for c in got if c not in want]
    what = (f"lacks {', '.join(missing[:3])}" if missing else f"has {', '.join(extra[:3])}") if (
        missing or extra
    ) else "has the columns in another order"  # fmt: skip
    return (
        f"{path}: not this sweep's results ({where} {what}; timing columns come with a timing grid); "
        "--force (force=True) to replace it, or another --out (out=FILE)"
    )


def _unique(rows: list[dict[str, object]], results: Results) -> list[dict[str, object]]:
    """One row per cell: the last read wins (a journal after the file it was resuming)."""
    timing = len(results.cols) > len(COUNT_COLUMNS)
    return list({identity(r, timing): r for r in rows}.values())


def _pyarrow(path: str | Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExpertcacheError(f"{path}: writing Parquet needs pyarrow: {PARQUET_HINT}") from None
    return pa, pq
