"""Traces from the tools people run: routing logs as JSON lines or CSV, into the ``.npz`` trace format.

Both formats hold one record per (request, token, layer):

- **JSON lines** (``.jsonl``), as vLLM routing loggers write them: ``{"req_id": "r1", "token_idx": 0,
  "layer": 3, "topk_ids": [5, 9], "topk_weights": [0.6, 0.4]}``. ``req_id`` and ``topk_weights`` are
  optional; ``is_prefill`` (or ``phase``: ``"prefill"``/``"decode"``, or ``"prompt"``/``"generate"``; any
  other value is refused) and ``token_id`` are kept when present. Lines without ``layer`` (a logger's
  ``{"type": "meta", ...}`` header) are metadata: their fields go to the trace's metadata.
- **CSV** (``.csv``), one row per token and layer, with a header: ``token_idx``, ``layer``, the experts as
  ``topk_ids`` (ids separated by spaces, ``;`` or ``|``) or as ``expert_0``, ``expert_1``, ..., and
  optionally ``req_id``, ``topk_weights`` / ``weight_0``, ..., ``is_prefill``, ``token_id``.

Tokens are ordered by request (in order of first appearance) and ``token_idx``; layers are numbered in
order of their ids (kept as the ``layer_ids`` metadata). Without ``req_id`` a request ends where
``token_idx`` goes back. A log that skips token indices or layer ids (a sampled one) is laid out as
logged, one after another, with a note. A (token, layer) a log does not hold is unknown (expert -1). Top-k
is the widest record's: a record with fewer ids keeps its missing slots unknown (-1), and a note counts
such records and names the first (a truncated row shows there). An expert named twice in one record is
refused: a router picks an expert at most once per token. Records with ``topk_weights`` and records
without are refused together. Leading profiling rows are left out and reported: vLLM runs a dummy batch
through the model before serving, which loggers record first. A leading request counts as profiling when
its ``req_id`` says so (``dummy``, ``profile``, ``warmup``) or, without ids, when every token of it routes
identically in every layer (dummy inputs are one repeated token).
"""

from __future__ import annotations

import csv
import json
import numbers
import re
from pathlib import Path

import numpy as np

from expertcache.errors import TraceError, did_you_mean, option
from expertcache.trace.trace import Trace

FORMATS = ("jsonl", "csv")
PROFILING = re.compile(r"dummy|profil|warm", re.I)
# the fields of a JSONL routing record the importer reads (any other is noted, not dropped in silence)
JSONL_FIELDS = ("req_id", "request_id", "token_idx", "layer", "topk_ids", "topk_weights", "is_prefill",
                "phase", "token_id", "type")  # fmt: skip


class _Rows:
    """Records gathered as (request, token, layer) -> experts, weights; then laid out as a trace."""

    def __init__(self, source: str) -> None:
        self.source = source
        # (request, token, layer) -> experts, weights, where the record is (for notes)
        self.routes: dict[tuple[object, int, int], tuple[list[int], list[float] | None, str]] = {}
        self.extra: dict[tuple[object, int], dict[str, int]] = {}  # (request, token) -> is_prefill, token_id
        self.requests: dict[object, None] = {}  # in order of first appearance
        self.meta: dict[str, object] = {}
        self._last: dict[int, int] = {}  # layer -> last token_idx (request boundaries without ids)
        self._auto = 0
        self.has_ids = None
        self.unknown_fields: dict[str, str] = {}  # a record's field the importer does not read -> where
        self.conflicts: dict[str, str] = {}  # a token's field that its layers' records disagree on -> where

    def add(self, where: str, req, token, layer, experts, weights=None, prefill=None, token_id=None) -> None:
        if self.has_ids is None:
            self.has_ids = req is not None
        if (req is not None) != self.has_ids:
            raise TraceError(f"{where}: 'req_id' is given for some records and not for others")
        if req is not None and not isinstance(req, str | int) or isinstance(req, bool):
            raise TraceError(f"{where}: req_id must be text or a whole number, got {req!r}")
        token, layer = _int(where, "token_idx", token), _int(where, "layer", layer)
        if token < 0 or layer < 0:
            raise TraceError(f"{where}: token_idx and layer must be >= 0")
        if req is None:  # a request ends where token_idx goes back (in any layer)
            if token <= self._last.get(layer, -1):
                self._auto += 1
                self._last = {}
            self._last[layer] = token
            req = self._auto
        ids = [_int(where, "topk_ids", e) for e in experts]
        if not ids:
            raise TraceError(f"{where}: no expert ids")
        outside = next((e for e in ids if not -1 <= e <= np.iinfo(np.int16).max), None)
        if outside is not None:
            raise TraceError(f"{where}: expert id {outside} is outside 0..32767 (-1: unknown)")
        known = [e for e in ids if e >= 0]  # -1: an unknown slot, as often as it likes
        if len(set(known)) != len(known):
            twice = next(e for e in known if known.count(e) > 1)
            raise TraceError(
                f"{where}: expert {twice} appears twice in the top-k of {self._at(req, token, layer)} "
                "(a router picks an expert at most once per token)"
            )
        w = None
        if weights is not None:
            try:
                w = [float(x) for x in weights]
            except (TypeError, ValueError):
                raise TraceError(f"{where}: topk_weights must be a list of numbers") from None
            if len(w) != len(ids):
                raise TraceError(f"{where}: {len(w)} weights for {len(ids)} experts")
        key = (req, token, layer)
        if key in self.routes:
            raise TraceError(f"{where}: a second record of request {req!r}, token {token}, layer {layer}")
        self.routes[key] = (ids, w, where)
        self.requests.setdefault(req)
        info = self.extra.setdefault((req, token), {})
        for field, value in (("is_prefill", prefill), ("token_id", token_id)):
            if value is None:
                continue
            value = value if field == "is_prefill" else _int(where, field, value)
            if field in info and info[field] != value and field not in self.conflicts:  # per token, not layer
                self.conflicts[field] = f"{where}: {field} {value} where another layer said {info[field]}"
            info[field] = value

    def trace(self, num_experts: int | None, skip_profiling: bool) -> tuple[Trace, list[str]]:
        if not self.routes:
            raise TraceError(f"{self.source}: no routing records")
        notes = []
        requests = list(self.requests)
        profiling = len(requests) > 1 and self._profiling(requests[0])
        if skip_profiling and profiling:
            first = requests.pop(0)
            rows = sum(1 for k in self.routes if k[0] == first)
            why = f"request {first!r}" if self.has_ids else "its every token routed alike in every layer"
            notes.append(f"left out {rows} leading profiling rows ({why})")
        for field, where in self.unknown_fields.items():  # a misspelt topk_weight dropped every weight
            hint = did_you_mean(field, JSONL_FIELDS)
            notes.append(
                f"ignored the field {field!r}{hint} (first at {where.removeprefix(self.source + ': ')})"
            )
        for said in self.conflicts.values():
            notes.append(f"{said.removeprefix(self.source + ': ')}: the last record's is kept")
        kept = set(requests)
        routes = [(key, v) for key, v in self.routes.items() if key[0] in kept]  # in the log's order
        weighted = [v[1] is not None for _, v in routes]
        if any(weighted) and not all(weighted):
            raise TraceError(
                self._mixed_weights(routes, requests[0] if profiling and not skip_profiling else None)
            )
        layers = sorted({k[2] for k, _ in routes})
        if len(layers) > 1 and layers[-1] - layers[0] + 1 != len(layers):  # a sampled log: said, not hidden
            shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
            notes.append(
                f"the layers logged ({shown}) skip some ids: the trace's {len(layers)} layers are these, "
                "numbered in order (layer_ids keeps them), so a layer ahead is the next one logged"
            )
        col = {lid: i for i, lid in enumerate(layers)}
        k = max(len(v[0]) for _, v in routes)
        short = [(key, v[2]) for key, v in routes if len(v[0]) < k]
        if short:
            (r, t, lid), where = short[0]
            have = "has" if len(short) == 1 else "have"
            notes.append(
                f"{len(short)} of {len(routes)} rows {have} fewer than {k} expert ids (top-k is the widest "
                f"row's); the first: {where.removeprefix(self.source + ': ')} ({self._at(r, t, lid)}); "
                "their missing slots are unknown (-1)"
            )
        by_request: dict[object, list[int]] = {r: [] for r in requests}
        for r, t in self.extra:  # every (request, token) a record named, once each
            if r in by_request:
                by_request[r].append(t)
        tokens = [(r, t) for r in requests for t in sorted(by_request[r])]
        gaps = [
            (r, a, b) for (r, a), (q, b) in zip(tokens, tokens[1:], strict=False) if q == r and b != a + 1
        ]
        if gaps:  # a sampled log: its tokens laid out one after another, said
            r, a, b = gaps[0]
            whose = f"request {r!r}, " if self.has_ids else ""
            notes.append(
                f"{len(gaps)} gap(s) in the token indices (the first: {whose}token {a} then {b}): the "
                "tokens logged are laid out one after another, so the next token is the next one logged"
            )
        row = {rt: i for i, rt in enumerate(tokens)}
        ex = np.full((len(tokens), len(layers), k), -1, dtype=np.int64)
        wt = np.full(ex.shape, np.nan, dtype=np.float32) if all(weighted) else None
        for (r, t, lid), (ids, w, _) in routes:
            i, j = row[(r, t)], col[lid]
            ex[i, j, : len(ids)] = ids
            if wt is not None:
                wt[i, j, : len(w)] = w
        if wt is not None:
            wt[(ex < 0)] = np.nan  # unknown entries: any weight (read as 0)
        if ex.max() > np.iinfo(np.int16).max or ex.min() < -1:
            raise TraceError(f"{self.source}: expert ids outside 0..32767")
        # the largest id of every record read, the left-out profiling ones too: an expert the model has
        # is one of its experts, whether the kept rows route to it or not (shares and "all" count them)
        need = max(int(ex.max()), max(max(v[0], default=-1) for v in self.routes.values())) + 1
        if num_experts is None:
            given = self.meta.get("num_experts")
            if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
                raise TraceError(
                    f"{self.source}: the header's num_experts must be a whole number >= 1, got {given!r}"
                )
            num_experts = given or need
        if need > num_experts:
            raise TraceError(f"{self.source}: expert id {need - 1} is out of range for {num_experts} experts")
        index = {r: i for i, r in enumerate(requests)}
        seq = np.asarray([index[r] for r, _ in tokens], dtype=np.int32)
        extra = [self.extra.get(rt, {}) for rt in tokens]
        prefill = token_id = None
        if any("is_prefill" in e for e in extra):
            prefill = np.asarray([e.get("is_prefill", -1) for e in extra], dtype=np.int8)
        if any("token_id" in e for e in extra):
            token_id = np.asarray([e.get("token_id", -1) for e in extra], dtype=np.int32)
        meta = {**self.meta, "layer_ids": np.asarray(layers), "imported_from": Path(self.source).name}
        meta = {key: v for key, v in meta.items() if key not in ("num_experts", "top_k", "num_layers")}
        trace = Trace(
            experts=ex.astype(np.int16), num_experts=num_experts, weights=wt, seq_id=seq, is_prefill=prefill,
            token_id=token_id, meta=meta, source=self.source,
        )  # fmt: skip
        return trace, notes

    def _at(self, req, token: int, layer: int) -> str:
        """A record in the log's terms: its request (when the log names them), token_idx and layer."""
        return (f"request {req!r}, " if self.has_ids else "") + f"token {token}, layer {layer}"

    def _mixed_weights(self, routes: list, profiling) -> str:
        """Why some records have topk_weights and others not; ``profiling``: the kept profiling request."""
        if profiling is not None:
            inside = {v[1] is not None for key, v in routes if key[0] == profiling}
            outside = {v[1] is not None for key, v in routes if key[0] != profiling}
            if len(inside) == len(outside) == 1 and inside != outside:
                who = f"request {profiling!r}" if self.has_ids else "every token routed alike"
                if outside == {True}:
                    return (
                        f"{self.source}: the kept profiling run's records ({who}) have no topk_weights while "
                        "the others do: import without --keep-profiling, or give the profiling records "
                        "weights"
                    )
                return (
                    f"{self.source}: the kept profiling run's records ({who}) have topk_weights while the "
                    "others do not: import without --keep-profiling, or give every record weights"
                )
        first = routes[0][1][1] is not None
        (r, t, lid), (_, _, where) = next((key, v) for key, v in routes if (v[1] is not None) != first)
        has, lacks = ("has no", "have them") if first else ("has", "have none")
        return (
            f"{where}: {self._at(r, t, lid)} {has} topk_weights while the records before it {lacks}: "
            "give every record topk_weights, or none"
        )

    def _profiling(self, req) -> bool:
        if self.has_ids:
            return bool(PROFILING.search(str(req)))
        routes = [(k[1], k[2], tuple(v[0])) for k, v in self.routes.items() if k[0] == req]
        by_layer: dict[int, set] = {}
        tokens = {t for t, _, _ in routes}
        for _, layer, ids in routes:
            by_layer.setdefault(layer, set()).add(ids)
        return len(tokens) > 1 and all(len(s) == 1 for s in by_layer.values())


def _int(where: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str | float) or str(value).strip() == "":
        raise TraceError(f"{where}: '{name}' must be an integer, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise TraceError(f"{where}: '{name}' must be an integer, got {value!r}") from None
    if number != int(number):
        raise TraceError(f"{where}: '{name}' must be an integer, got {value!r}")
    return int(number)


def _prefill(record: dict, where: str) -> int | None:
    """1 for a prompt token, 0 for a generated one, -1 unknown, None when the record does not say."""
    if "is_prefill" in record:
        v = str(record["is_prefill"]).strip().lower()
        value = {"1": 1, "true": 1, "0": 0, "false": 0, "-1": -1, "": -1, "none": -1}.get(v)
        if value is None:
            raise TraceError(
                f"{where}: 'is_prefill' must be 1, 0, true, false or -1, got {record['is_prefill']!r}"
            )
        return value
    if "phase" not in record or record["phase"] is None or not str(record["phase"]).strip():
        return None
    phase = str(record["phase"]).strip().lower()
    value = _PHASES.get(phase)
    if value is None:  # not taken for "unknown" in silence
        raise TraceError(
            f"{where}: 'phase' must be prefill or decode, or prompt or generate, got {record['phase']!r}"
        )
    return value


# a record's phase as engines name it: the prompt's tokens, or generated ones
_PHASES = {"prefill": 1, "prompt": 1, "decode": 0, "decoding": 0, "generate": 0, "generation": 0}


def _jsonl(path: Path, rows: _Rows) -> None:
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is dropped
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}: line {n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{where}: a record is a JSON object")
            if "layer" not in rec:  # a header or metadata line
                rows.meta.update(
                    {k: v for k, v in rec.items() if isinstance(v, int | float | str) and k != "type"}
                )
                continue
            for field in ("token_idx", "topk_ids"):
                if field not in rec:
                    raise TraceError(f"{where}: no '{field}'")
            if not isinstance(rec["topk_ids"], list):
                raise TraceError(f"{where}: 'topk_ids' must be a list of expert ids")
            for field in rec:
                if field not in JSONL_FIELDS and field not in rows.unknown_fields:
                    rows.unknown_fields[field] = where
            req = rec.get("req_id", rec.get("request_id"))
            rows.add(
                where, req, rec["token_idx"], rec["layer"], rec["topk_ids"], rec.get("topk_weights"),
                _prefill(rec, where), rec.get("token_id"),
            )  # fmt: skip


def _split(cell: str) -> list[str]:
    return [x for x in re.split(r"[\s;|,]+", cell.strip().strip("[]")) if x]


def _csv(path: Path, rows: _Rows) -> None:
    with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: a byte-order mark (Excel's) is dropped
        reader = csv.DictReader(f)
        head = reader.fieldnames or []
        if head and all(re.fullmatch(r"[-\d\s.;|]*", c) for c in head):  # a row of values, not of names
            raise TraceError(
                f"{path}: the first line holds values, not column names: a CSV routing log starts with a "
                "header (token_idx,layer,topk_ids, ...)"
            )
        twice = sorted({c for c in head if head.count(c) > 1})
        if twice:  # DictReader keeps the last column of a name: the other would be lost in silence
            raise TraceError(f"{path}: the header names {', '.join(twice)} twice")
        experts = sorted((c for c in head if re.fullmatch(r"expert_\d+", c)), key=lambda c: int(c[7:]))
        weights = sorted((c for c in head if re.fullmatch(r"weight_\d+", c)), key=lambda c: int(c[7:]))
        missing = [c for c in ("token_idx", "layer") if c not in head]
        if "topk_ids" not in head and not experts:
            missing.append("topk_ids (or expert_0, expert_1, ...)")
        if missing:
            raise TraceError(
                f"{path}: the header has no {', '.join(missing)} (it has {', '.join(head) or 'nothing'})"
            )
        read = {"topk_weights", *experts, *weights, *(f for f in JSONL_FIELDS if f != "type")}
        if "topk_ids" in head:  # topk_ids is read: expert_N beside it are not (nor weight_N beside weights)
            read -= set(experts)
        if "topk_weights" in head:
            read -= set(weights)
        for column in head:  # a column the importer does not read is noted, as a JSONL field is
            if column not in read:
                rows.unknown_fields.setdefault(column, f"{path}: line 1")
        for n, rec in enumerate(reader, 2):
            where = f"{path}: line {n}"
            if None in rec or None in rec.values():  # more fields than the header, or fewer (a cut row)
                got = len(head) + len(rec.get(None) or ()) - sum(v is None for v in rec.values())
                raise TraceError(f"{where}: {got} field(s), the header has {len(head)}")
            ids = (
                _split(rec["topk_ids"])
                if "topk_ids" in head
                else [rec[c] for c in experts if rec[c] not in ("", None)]
            )
            w = None
            if "topk_weights" in head and rec["topk_weights"]:
                w = _split(rec["topk_weights"])
            elif weights:
                w = [rec[c] for c in weights if rec[c] not in ("", None)]
            try:
                w = None if w is None else [float(x) for x in w]
            except ValueError:
                raise TraceError(f"{where}: weights must be numbers") from None
            req = rec.get("req_id", rec.get("request_id"))  # as a JSONL record names it
            rows.add(
                where,
                req,
                rec["token_idx"],
                rec["layer"],
                ids,
                w,
                _prefill(rec, where),
                rec.get("token_id") or None,
            )


def import_trace(
    path: str | Path, fmt: str | None = None, num_experts: int | None = None, skip_profiling: bool = True
) -> tuple[Trace, list[str]]:
    """Read a routing log (``fmt``: ``jsonl`` or ``csv``; default: by the file's suffix) as a trace.
    -> (the trace, notes for the user: what was left out). ``num_experts`` defaults to the log's
    ``num_experts`` metadata, else the largest id + 1."""
    path = Path(path)
    fmt = fmt or {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv"}.get(
        path.suffix.lower()
    )
    torch_file = fmt is None and path.suffix.lower() in (".pt", ".pth")
    if fmt in ("torch", "pt") or torch_file:  # torch's format: read where torch may be imported
        raise TraceError(
            f"{path}: a torch file is read by expertcache.tools.trace_import.import_torch (this module is "
            "torch-free)"
        )
    if path.is_dir():
        raise TraceError(f"{path}: a folder, not a routing log")
    if path.suffix.lower() == ".npz":
        from expertcache.trace.trace import load_trace

        load_trace(path)  # a file named .npz that is no trace is said to be none (it was called one)
        raise TraceError(f"{path}: already a trace (.npz): give it to the commands as it is")
    if fmt not in FORMATS:
        formats = " or ".join(FORMATS)
        flag = option("--format", "fmt=")
        given = "" if fmt is None else f"{flag}{fmt!r} is not one; "  # the value named, not asked for again
        torch = option("--format torch for .pt", "tools.trace_import.import_torch for .pt")
        raise TraceError(f"{path}: {given}give the format ({flag} {formats}, or {torch})")
    whole = isinstance(num_experts, numbers.Integral) and not isinstance(num_experts, bool)
    if num_experts is not None and (not whole or num_experts < 1):
        raise TraceError(f"num_experts must be a whole number >= 1, got {num_experts!r}")
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    rows = _Rows(str(path))
    try:
        (_jsonl if fmt == "jsonl" else _csv)(path, rows)
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text") from None
    except csv.Error as exc:
        raise TraceError(f"{path}: not CSV ({exc})") from None
    return rows.trace(num_experts, skip_profiling)
