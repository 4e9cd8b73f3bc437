"""The cold-start bandwidth model written by ``ncclwatch fit`` and read by the Pipeline.

Per (transport class, op) the model holds an alpha-beta line,

    exec_ns = alpha_ns + bus_bytes / beta_gbs,

where ``bus_bytes = traffic_bytes x bus_factor`` (``ncclwatch.rules``), so ``beta_gbs`` is
the asymptotic *bus* bandwidth and ``alpha_ns`` the fixed latency; plus the median bus
bandwidth of every size bucket seen in the history. A bucket that was seen answers from
its median, any other size from the line. The file is plain JSON (never pickle): it is
read by long-running workers and may come from another machine.

>>> m = BusbwModel({("net", "AllReduce"): ModelEntry(alpha_ns=20_000.0, beta_gbs=40.0)})
>>> round(m.predict_busbw_gbs("net", "AllReduce", 64 << 20, nranks=2), 1)
39.5
>>> m.predict_busbw_gbs("nvlink", "AllReduce", 64 << 20, nranks=2) is None
True
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ncclwatch.rules import bus_factor, traffic_bytes

MODEL_FORMAT = "ncclwatch.busbw_model"
MODEL_VERSION = 1


@dataclass
class ModelEntry:
    """One (transport, op): the fitted line and the per-bucket medians."""

    alpha_ns: float
    beta_gbs: float
    n_samples: int = 0
    min_bytes: int = 0
    max_bytes: int = 0
    rel_mad: float = 0.0  # median |relative residual| of the line on the bucket medians
    buckets: dict[str, float] = field(default_factory=dict)  # size bucket -> median busbw


def bus_bytes(op: str, msg_bytes: float, nranks: int) -> float:
    """Bytes on the bus for one op: traffic times the bus factor (nccl-tests' busbw numerator).

    >>> bus_bytes("AllReduce", 1000, 4)
    1500.0
    """
    return traffic_bytes(op, int(msg_bytes), nranks) * bus_factor(op, nranks)


class BusbwModel:
    """Expected bus bandwidth by transport class, op and message size."""

    def __init__(self, entries: dict[tuple[str, str], ModelEntry] | None = None, meta=None):
        self.entries = dict(entries or {})
        self.meta: dict[str, Any] = dict(meta or {})

    def predict_exec_ns(self, transport: str, op: str, msg_bytes: float, nranks: int):
        e = self.entries.get((transport, op))
        if e is None or e.beta_gbs <= 0:
            return None
        return e.alpha_ns + bus_bytes(op, msg_bytes, nranks) / e.beta_gbs

    def predict_busbw_gbs(
        self,
        transport: str,
        op: str,
        msg_bytes: float,
        nranks: int,
        size_bucket: str | None = None,
    ) -> float | None:
        e = self.entries.get((transport, op))
        if e is None:
            return None
        if size_bucket is not None and size_bucket in e.buckets:
            return e.buckets[size_bucket]
        exec_ns = self.predict_exec_ns(transport, op, msg_bytes, nranks)
        bb = bus_bytes(op, msg_bytes, nranks)
        if not exec_ns or exec_ns <= 0 or bb <= 0:
            return None
        return bb / exec_ns

    # --- file format --------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MODEL_FORMAT,
            "version": MODEL_VERSION,
            "meta": self.meta,
            "entries": [
                {"transport": t, "op": o, **asdict(e)} for (t, o), e in sorted(self.entries.items())
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BusbwModel:
        if d.get("format") != MODEL_FORMAT or d.get("version") != MODEL_VERSION:
            raise ValueError(
                f"not an ncclwatch model file (format {d.get('format')!r}, "
                f"version {d.get('version')!r})"
            )
        entries = {}
        for raw in d["entries"]:
            raw = dict(raw)
            key = (raw.pop("transport"), raw.pop("op"))
            e = ModelEntry(**raw)
            if not (math.isfinite(e.alpha_ns) and math.isfinite(e.beta_gbs)):
                raise ValueError(f"model entry {key} has non-finite parameters")
            entries[key] = e
        return cls(entries, d.get("meta"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BusbwModel:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def resolve(cls, model: BusbwModel | str | Path | None, model_path: str) -> BusbwModel | None:
        """The model a detector was given (an object or a path), else ``model_path``'s."""
        if model is None and model_path:
            model = model_path
        if isinstance(model, (str, Path)):
            model = cls.load(model)
        return model
