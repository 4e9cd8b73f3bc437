"""``ncclwatch fit``: learn expected bus bandwidth from history (scikit-learn).

For each (transport class, op) the history gives execution times at several message
sizes. The alpha-beta model ``exec_ns = alpha + bus_bytes / beta`` is fitted robustly
with scikit-learn's ``HuberRegressor`` in *relative* form, dividing by the observed time,

    1 = alpha * (1 / exec) + (1 / beta) * (bus_bytes / exec),

so a 10 us latency-bound op weighs as much as a 10 ms bandwidth-bound one and a few
10x-slow calls do not drag the line (Huber's loss is linear for large residuals). Every
size bucket has the same total weight however many ops it had. The result, with the
median bus bandwidth of each bucket, goes to a JSON model file (:mod:`.model`) that the
Pipeline uses as the baseline of a key before its warm-up completes and for buckets it
has not seen.

Input: op records (``kind: op``) or window summaries (``kind: window``, using
``bytes / count`` and ``exec_ns_p50``) from JSONL files, ``.gz`` files, or directories of
them (a spool). :func:`fit_from_records` takes any iterable of records, so a Kafka
topic reader can feed it too.
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ncclwatch.records import OpRecord, WindowSummary, parse_line
from ncclwatch.rules import size_bucket, size_bucket_bytes

from .model import BusbwModel, ModelEntry, bus_bytes

MAX_SAMPLES_PER_BUCKET = 4000  # reservoir per (transport, op, bucket): bounded memory


class _Samples:
    """Reservoir of (bus_bytes, exec_ns, busbw) per bucket, deterministic by seed."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.data: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
        self.seen: dict[tuple[str, str, str], int] = {}

    def add(self, key: tuple[str, str, str], sample: tuple[float, float, float]) -> None:
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        bucket = self.data.setdefault(key, [])
        if len(bucket) < MAX_SAMPLES_PER_BUCKET:
            bucket.append(sample)
        else:
            j = self.rng.randrange(n)
            if j < MAX_SAMPLES_PER_BUCKET:
                bucket[j] = sample


def _sample(rec: Any) -> tuple[tuple[str, str, str], tuple[float, float, float]] | None:
    if isinstance(rec, OpRecord):
        msg, exec_ns, nranks = float(rec.bytes), float(rec.exec_ns), rec.nranks
    elif isinstance(rec, WindowSummary):
        if rec.count <= 0:
            return None
        msg, exec_ns, nranks = rec.bytes / rec.count, float(rec.exec_ns_p50), rec.nranks
    else:
        return None
    if rec.transport == "single" or exec_ns <= 0 or msg <= 0:
        return None
    bb = bus_bytes(rec.op, msg, nranks)
    if bb <= 0:
        return None
    return (rec.transport, rec.op, size_bucket(int(msg))), (bb, exec_ns, bb / exec_ns)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def fit_alpha_beta(rows: list[tuple[float, float]], weights: list[float] | None = None):
    """Robust ``(alpha_ns, beta_gbs)`` from ``(bus_bytes, exec_ns)`` pairs.

    >>> import random
    >>> rng = random.Random(0)
    >>> rows = [(b, (20_000 + b / 40.0) * rng.lognormvariate(0, 0.03))
    ...         for b in (2 ** k for k in range(10, 30)) for _ in range(30)]
    >>> alpha, beta = fit_alpha_beta(rows)
    >>> round(alpha / 1000), round(beta)
    (20, 40)
    """
    import numpy as np
    from sklearn.linear_model import HuberRegressor

    x = np.array([r[0] for r in rows], dtype=float)
    y = np.array([r[1] for r in rows], dtype=float)
    feats = np.column_stack([1.0 / y, x / y])
    # Scale the columns to unit RMS: L-BFGS inside Huber is poorly conditioned when
    # one feature is ~1e-5 and the other ~10.
    scale = np.sqrt((feats**2).mean(axis=0))
    scale[scale == 0] = 1.0
    w = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=float)
    model = HuberRegressor(epsilon=1.35, alpha=0.0, fit_intercept=False, max_iter=500)
    model.fit(feats / scale, np.ones(len(rows)), sample_weight=w)
    alpha, inv_beta = (model.coef_ / scale).tolist()
    if inv_beta <= 0:
        raise ValueError("no positive bandwidth term: sizes too similar or data inconsistent")
    if alpha < 0:
        # A negative latency is noise around zero: fix alpha at 0 and refit beta alone.
        alpha = 0.0
        inv_beta = float(np.average(y / x, weights=w))
    return float(alpha), float(1.0 / inv_beta)


def fit_from_records(records: Iterable[Any], *, min_samples: int = 5, seed: int = 0) -> BusbwModel:
    """Fit the model from op records and/or window summaries (anything else is skipped)."""
    samples = _Samples(seed)
    n_used = 0
    for rec in records:
        s = _sample(rec)
        if s is not None:
            samples.add(*s)
            n_used += 1
    groups: dict[tuple[str, str], dict[str, list[tuple[float, float, float]]]] = {}
    for (transport, op, bucket), data in samples.data.items():
        if len(data) >= min_samples:
            groups.setdefault((transport, op), {})[bucket] = data
    entries: dict[tuple[str, str], ModelEntry] = {}
    for key, buckets in sorted(groups.items()):
        rows: list[tuple[float, float]] = []
        weights: list[float] = []
        medians = {}
        for bucket, data in buckets.items():
            rows.extend((bb, ex) for bb, ex, _ in data)
            weights.extend([1.0 / len(data)] * len(data))
            medians[bucket] = (
                _median([bb for bb, _, _ in data]),
                _median([ex for _, ex, _ in data]),
                _median([bw for _, _, bw in data]),
            )
        if len(buckets) >= 2:
            alpha, beta = fit_alpha_beta(rows, weights)
        else:
            # One size cannot separate latency from bandwidth: all of it is "bandwidth".
            alpha, beta = 0.0, next(iter(medians.values()))[2]
        rel = [abs((alpha + bb / beta) / ex - 1.0) for bb, ex, _ in medians.values()]
        sizes = [int(bb) for bb, _, _ in medians.values()]
        entries[key] = ModelEntry(
            alpha_ns=round(alpha, 3),
            beta_gbs=round(beta, 6),
            n_samples=sum(samples.seen[(key[0], key[1], b)] for b in buckets),
            min_bytes=min(sizes),
            max_bytes=max(sizes),
            rel_mad=round(_median(rel), 6),
            buckets={b: round(m[2], 6) for b, m in _by_size(medians)},
        )
    return BusbwModel(entries, {"records_used": n_used, "fitter": "sklearn.HuberRegressor"})


def _by_size(medians: dict[str, tuple[float, float, float]]):
    return sorted(medians.items(), key=lambda kv: size_bucket_bytes(kv[0]))


def load_model(path: str | Path) -> BusbwModel:
    """Read a model file written by ``ncclwatch fit``."""
    return BusbwModel.load(path)


# --- reading history -----------------------------------------------------------------

def iter_paths(paths: Iterable[Path]) -> Iterator[Path]:
    for p in paths:
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and (f.name.endswith(".jsonl") or f.name.endswith(".jsonl.gz")):
                    yield f
        else:
            yield p


def iter_records(paths: Iterable[Path], stats: dict[str, int] | None = None) -> Iterator[Any]:
    """Records from JSONL / gzip files and directories; bad lines are counted, not fatal."""
    stats = stats if stats is not None else {}
    for path in iter_paths(paths):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            for offset, line in enumerate(f):
                if not line.endswith(b"\n"):
                    stats["partial"] = stats.get("partial", 0) + 1  # still being written
                    continue
                rec = parse_line(line.rstrip(b"\n"), source=str(path), offset=offset)
                if rec.KIND == "quarantined":
                    stats["bad"] = stats.get("bad", 0) + 1
                    continue
                stats[rec.KIND] = stats.get(rec.KIND, 0) + 1
                yield rec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", type=Path,
                        help="op-record / window JSONL files, .gz files or spool directories")
    parser.add_argument("-o", "--output", type=Path,
                        help="model file to write (default: detector.model_path)")
    parser.add_argument("--min-samples", type=int, default=5,
                        help="ignore size buckets with fewer samples (default %(default)s)")


def run(args: argparse.Namespace, cfg: Any) -> int:
    out = args.output or (Path(cfg.detector.model_path) if cfg.detector.model_path else None)
    if out is None:
        print("ncclwatch fit: give -o FILE or set detector.model_path", file=sys.stderr)
        return 2
    stats: dict[str, int] = {}
    model = fit_from_records(iter_records(args.inputs, stats), min_samples=args.min_samples)
    if not model.entries:
        print(f"ncclwatch fit: no usable op or window records ({stats})", file=sys.stderr)
        return 1
    model.meta["inputs"] = [str(p) for p in args.inputs]
    model.save(out)
    print(f"{'transport':9} {'op':14} {'alpha_us':>9} {'beta_GB/s':>10} {'sizes':>5} "
          f"{'samples':>8} {'rel_err':>7}")
    for (transport, op), e in sorted(model.entries.items()):
        print(f"{transport:9} {op:14} {e.alpha_ns / 1000:9.2f} {e.beta_gbs:10.2f} "
              f"{len(e.buckets):5d} {e.n_samples:8d} {100 * e.rel_mad:6.1f}%")
    print(f"wrote {out} ({stats})")
    return 0
