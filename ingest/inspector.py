"""Source mapping: NCCL Inspector output (plugins/profiler/inspector, NCCL 2.30) -> the contract.

JSON mode writes ``<dump dir>/<hostname>-pid<pid>.log``, one JSON object per line::

    {"header": {"id": "0x7f8c496ae9f661", "comm_name": "dp", "rank": 2, "n_ranks": 8,
                "nnodes": 1},
     "metadata": {"inspector_output_format_version": "v4.0", "git_rev": "",
                  "rec_mechanism": "nccl_profiler_interface",
                  "dump_timestamp_us": 1748030377748202, "hostname": "h", "pid": 1639453},
     "coll_perf": {"coll": "AllReduce", "coll_sn": 1407, "coll_msg_size_bytes": 17179869184,
                   "coll_exec_time_us": 61974, "coll_timing_source": "kernel_gpu",
                   "coll_algobw_gbs": 277.210914, "coll_busbw_gbs": 485.119099}}

(``p2p_perf`` with ``p2p``, ``p2p_sn``, ``p2p_peer``, ``p2p_msg_size_bytes`` … for
Send/Recv; verbose mode adds ``event_trace_sn`` / ``event_trace_ts`` with per-channel
``kernel_start_ts`` in host microseconds). :func:`op_from_inspector` maps one such line to
an ``op`` record; see docs/ingest.md for what each field becomes and what is not known.

Prometheus mode rewrites ``nccl_inspector_metrics_<gpu uuid>.prom`` every dump interval
(>= 30 s) with, per (comm name, nranks, nnodes, op, message-size range[, algo_proto]),
the *arithmetic mean* execution time and the *geometric mean* bus bandwidth of the ops
completed in that interval. :func:`windows_from_prom` maps a file to window summaries.

>>> line = (b'{"header":{"id":"0xab","comm_name":"dp","rank":1,"n_ranks":8,"nnodes":1},'
...         b'"metadata":{"inspector_output_format_version":"v4.0","git_rev":"",'
...         b'"rec_mechanism":"nccl_profiler_interface","dump_timestamp_us":2000000,'
...         b'"hostname":"h","pid":9},"coll_perf":{"coll":"AllReduce","coll_sn":5,'
...         b'"coll_msg_size_bytes":1048576,"coll_exec_time_us":100,'
...         b'"coll_timing_source":"kernel_gpu","coll_algobw_gbs":10.48576,'
...         b'"coll_busbw_gbs":18.35008}}')
>>> op = op_from_inspector(line, job="j")
>>> op.comm, op.seq, op.exec_ns, op.start_ns, op.timing, round(op.busbw_gbs, 3)
('0x00000000000000ab', 5, 100000, 1999900000, 'inspector', 18.35)
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from ncclwatch import records, rules
from ncclwatch.records import UNKNOWN_GPU, OpRecord, Quarantined, RecordError, WindowSummary

# Inspector spells a few ops differently from NCCL's public names used in the contract.
_OP_NAMES = {"All2All": "AllToAll"}
_UNITS = {"B": 0, "KB": 10, "MB": 20, "GB": 30, "TB": 40}


class InspectorError(ValueError):
    """An Inspector line or metric that cannot be mapped; ``reason`` as in Quarantined."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class NotAnOp(InspectorError):
    """A well-formed Inspector line that describes no op: count it, do not quarantine it.

    An op Inspector could not name (``"Invalid"``), and a ``dump_stats`` marker (header,
    metadata, records written and dropped since the last dump; described in Inspector's
    design, written by no release up to v2.30.7). ``what`` names the kind of line;
    ``reason`` stays ``unknown_kind`` for callers that quarantine every
    :class:`InspectorError`.
    """

    def __init__(self, what: str):
        super().__init__("unknown_kind", f"an Inspector {what} line carries no op")
        self.what = what


def _num(value: Any, name: str) -> float:
    # Inspector prints a NaN double as the string "nan".
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InspectorError("schema", f"{name}: expected a number, got {type(value).__name__}")
    try:
        return float(value)
    except ValueError:
        raise InspectorError("schema", f"{name}: not a number: {value!r}") from None


def _int(obj: dict, name: str, minimum: int | None = None) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InspectorError("schema", f"{name}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InspectorError("schema", f"{name}: {value} is below {minimum}")
    return value


def _str(obj: dict, name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise InspectorError("schema", f"{name}: expected a string, got {value!r}")
    return value


def comm_name_of(name: str) -> str:
    """Inspector writes ``"unknown"`` for a communicator without a name; the contract ``""``."""
    return "" if name == "unknown" else name


def op_from_inspector(raw: bytes | str, *, job: str, gpu: str = UNKNOWN_GPU) -> OpRecord:
    """Map one Inspector JSON-mode line to an ``op`` record (raises InspectorError)."""
    if isinstance(raw, bytes):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InspectorError("not_utf8", str(e)) from None
    depth = records.nesting_depth(raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw)
    if depth > records.MAX_DEPTH:  # msgspec recurses: bound it before decoding
        raise InspectorError("too_deep", f"nested {depth} deep > {records.MAX_DEPTH}")
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:  # lone surrogate escapes, NaN and overflow included
        raise InspectorError("not_json", str(e)) from None
    if not isinstance(obj, dict):
        raise InspectorError("schema", "an Inspector record is a JSON object")
    header, meta = obj.get("header"), obj.get("metadata")
    if not isinstance(header, dict) or not isinstance(meta, dict):
        raise InspectorError("schema", "missing header or metadata object")
    version = meta.get("inspector_output_format_version")
    if not (isinstance(version, str) and version.startswith("v4.")):
        raise InspectorError("unknown_version", f"Inspector output format {version!r} (know v4.x)")
    if "coll_perf" in obj:
        perf, p = obj["coll_perf"], "coll"
    elif "p2p_perf" in obj:
        perf, p = obj["p2p_perf"], "p2p"
    elif "dump_stats" in obj:
        raise NotAnOp("dump_stats")
    else:
        raise InspectorError("unknown_kind", "neither coll_perf nor p2p_perf")
    if not isinstance(perf, dict):
        raise InspectorError("schema", f"{p}_perf is not an object")

    comm_id = _str(header, "id")
    try:
        comm = rules.comm_hex(int(comm_id, 16))
    except ValueError:
        raise InspectorError("schema", f"header.id {comm_id!r} is not a hex hash") from None
    rank = _int(header, "rank", 0)
    nranks = _int(header, "n_ranks", 1)
    nnodes = _int(header, "nnodes", 1)
    # Older Inspector versions have no comm_name in the header.
    name = header.get("comm_name")
    comm_name = comm_name_of(name) if isinstance(name, str) else ""
    host = _str(meta, "hostname")
    pid = _int(meta, "pid", 0)
    dump_us = _int(meta, "dump_timestamp_us", 0)

    op_name = _str(perf, p)
    if op_name == "Invalid":
        # Inspector's name for an op it has no name for (NCCL's AlltoAll, Gather, Scatter
        # when they reach it as collectives): ops of several kinds under one key would
        # be one baseline of unlike things. Counted, not measured.
        raise NotAnOp("invalid_op")
    op_name = _OP_NAMES.get(op_name, op_name)
    seq = _int(perf, f"{p}_sn", 0)
    nbytes = _int(perf, f"{p}_msg_size_bytes", 0)
    exec_ns = _int(perf, f"{p}_exec_time_us", 0) * 1000
    # Inspector times an op by its kernels' GPU timestamps (``kernel_gpu``), else by host
    # events (``kernel_cpu``, ``collective_cpu``: launch and queueing included, kept only
    # with NCCL_INSPECTOR_REQUIRE_KERNEL_TIMING=0), and writes 0 where it had nothing
    # usable (a Send/Recv without timestamps) or the op took under a microsecond. Only
    # the first is a measurement comparable with the others; the rest are counted as
    # untimed ops (``host``: no duration, no bandwidth), which only move stream time.
    source = perf.get(f"{p}_timing_source", "kernel_gpu")
    timed = source == "kernel_gpu" and exec_ns > 0
    peer = _int(perf, "p2p_peer") if p == "p2p" else -1
    _num(perf.get(f"{p}_busbw_gbs", "nan"), f"{p}_busbw_gbs")  # present and numeric (or "nan")

    # The op's start: verbose mode has the first kernel start (host clock, µs); otherwise
    # only the dump time is known, and the op ended at or before it.
    start_ns = None
    channels = 0
    trace = perf.get("event_trace_ts")
    if isinstance(trace, dict):
        kernels = trace.get("kernel_events")
        if isinstance(kernels, list) and kernels:
            channels = len(kernels)
            starts = [k.get("kernel_start_ts") for k in kernels if isinstance(k, dict)]
            starts = [s for s in starts if isinstance(s, int) and s > 0]
            if starts:
                start_ns = min(starts) * 1000
        if start_ns is None and isinstance(trace.get(f"{p}_start_ts"), int):
            start_ns = trace[f"{p}_start_ts"] * 1000
    if start_ns is None:
        start_ns = dump_us * 1000 - exec_ns
    if not timed:
        exec_ns = 0

    # Bandwidths are recomputed with the project's rules (Inspector uses the same
    # nccl-tests convention) so that a NaN printed as "nan" cannot leak through.
    algbw, busbw = rules.bandwidths_gbs(op_name, nbytes, nranks, exec_ns)
    transport = rules.transport_class(nranks, nnodes)
    return _checked(OpRecord(
        id=rules.record_id(job, host, pid, comm, rank, op_name, peer, seq),
        job=job,
        host=host,
        pid=pid,
        gpu=gpu,
        comm=comm,
        comm_name=comm_name,
        rank=rank,
        nranks=nranks,
        nnodes=nnodes,
        local_ranks=rules.local_ranks(nranks, nnodes),
        transport=transport,
        op=op_name,
        seq=seq,
        count=0,
        dtype="unknown",
        bytes=nbytes,
        peer=peer,
        algo="",
        proto="",
        channels=channels,
        start_ns=start_ns,
        exec_ns=exec_ns,
        timing="inspector" if timed else "host",
        algbw_gbs=algbw,
        busbw_gbs=busbw,
        graph=False,
    ))


def _checked(rec: Any) -> Any:
    """The mapped record if it keeps the contract (ranges, times, strings), else raise."""
    try:
        return records.check(rec)
    except RecordError as e:
        raise InspectorError(e.reason, e.detail) from None


def quarantine(
    err: InspectorError, raw: bytes, source: str, offset: int, stage: str
) -> Quarantined:
    cut = raw[:4096]
    return Quarantined(stage=stage, reason=err.reason, detail=err.detail, source=source,
                       offset=offset, raw=cut.decode("utf-8", errors="replace"))


# --- Prometheus mode --------------------------------------------------------------------

_SAMPLE = re.compile(rb'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\s+(\S+)(?:\s+-?\d+)?\s*$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?\s*')
_METRICS = {
    b"nccl_bus_bandwidth_gbs": ("coll", "busbw"),
    b"nccl_collective_exec_time_microseconds": ("coll", "exec"),
    b"nccl_p2p_bus_bandwidth_gbs": ("p2p", "busbw"),
    b"nccl_p2p_exec_time_microseconds": ("p2p", "exec"),
}
_GPU = re.compile(r"^GPU(\d+)$")


def message_size_lower_bytes(label: str) -> int:
    """Lower bound in bytes of Inspector's ``message_size`` label.

    >>> message_size_lower_bytes("134-135MB"), message_size_lower_bytes("0B")
    (140509184, 0)
    """
    if label == "0B":
        return 0
    m = re.fullmatch(r"(\d+)-(\d+)(B|KB|MB|GB|TB)", label)
    if not m:
        raise InspectorError("schema", f"message_size {label!r} is not Inspector's range label")
    return int(m.group(1)) << _UNITS[m.group(3)]


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise InspectorError("schema", f"bad label set near {text[pos:pos + 40]!r}")
        out[m.group(1)] = m.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = m.end()
    return out


def windows_from_prom(
    data: bytes, *, start_ns: int, end_ns: int, source: str = ""
) -> tuple[list[WindowSummary], list[Quarantined]]:
    """Map one ``.prom`` file's text to window summaries (and what could not be mapped).

    Each Inspector bucket becomes one sample: ``count`` is the number of Inspector
    buckets merged into the window key (buckets that differ only in ``algo_proto``
    share a key), every ``exec_ns_*`` statistic is the bucket's mean execution time,
    ``busbw_gbs_p50`` its geometric-mean bus bandwidth, ``bytes`` the size range's lower
    bound, ``rank`` the local CUDA device index from the ``gpu`` label, ``comm`` a
    pseudo hash of (comm_name, nranks, n_nodes): Inspector's .prom has no per-op counts,
    ranks or communicator hashes. Nearest-rank statistics over merged buckets.
    """
    from ncclwatch.ingest.windows import nearest_rank

    pairs: dict[tuple, dict[str, float]] = {}
    labels_of: dict[tuple, dict[str, str]] = {}
    bad: list[Quarantined] = []
    offset = 0
    for line in data.split(b"\n"):
        here = offset
        offset += len(line) + 1
        s = line.strip()
        if not s or s.startswith(b"#"):
            continue
        try:
            m = _SAMPLE.match(s)
            if m is None:
                raise InspectorError("not_json", "not a Prometheus exposition sample")
            kind = _METRICS.get(m.group(1))
            if kind is None:
                continue  # some other metric in the same directory: not ours to judge
            labels = _labels(m.group(2).decode("utf-8"))
            value = _num(m.group(3).decode(), m.group(1).decode())
            if not math.isfinite(value) or value < 0:
                raise InspectorError("schema", f"value {value!r} is not a finite number >= 0")
            ident = (kind[0], *sorted(labels.items()))
            pairs.setdefault(ident, {})[kind[1]] = value
            labels_of[ident] = labels
        except (InspectorError, UnicodeDecodeError) as e:
            err = e if isinstance(e, InspectorError) else InspectorError("not_utf8", str(e))
            stage = "schema" if err.reason == "schema" else "parse"
            bad.append(quarantine(err, line, source, here, stage))

    grouped: dict[tuple, list[tuple[int, float, dict[str, str]]]] = {}
    for ident, vals in pairs.items():
        labels = labels_of[ident]
        try:
            if "exec" not in vals or "busbw" not in vals:
                raise InspectorError("schema", "bus bandwidth and exec time must come in pairs")
            op_label = "collective" if ident[0] == "coll" else "p2p_operation"
            op_name = labels.get(op_label)
            if not op_name:
                raise InspectorError("schema", "no collective/p2p_operation label")
            op_name = _OP_NAMES.get(op_name, op_name)
            nranks = int(labels["nranks"])
            nnodes = int(labels["n_nodes"])
            if nranks < 1 or nnodes < 1:
                raise InspectorError("schema", "nranks and n_nodes must be >= 1")
            gpu = _GPU.match(labels.get("gpu", ""))
            lower = message_size_lower_bytes(labels["message_size"])
        except (KeyError, ValueError) as e:
            err = e if isinstance(e, InspectorError) else InspectorError("schema", f"label {e}")
            bad.append(quarantine(err, repr(sorted(labels.items())).encode(), source, 0, "schema"))
            continue
        comm_name = comm_name_of(labels.get("comm_name", "unknown"))
        pseudo = rules.fnv1a64(
            "\x1f".join(("inspector-prom", labels.get("comm_name", ""), str(nranks), str(nnodes)))
            .encode("utf-8")
        )
        key = (
            labels.get("slurm_job_id", "unknown"),
            labels.get("node", "unknown"),
            rules.comm_hex(pseudo),
            comm_name,
            op_name,
            rules.size_bucket(lower),
            rules.transport_class(nranks, nnodes),
            int(gpu.group(1)) if gpu else 0,
            nranks,
        )
        grouped.setdefault(key, []).append((int(round(vals["exec"] * 1000)), vals["busbw"], labels))

    out = []
    for key, samples in sorted(grouped.items()):
        job, host, comm, comm_name, op_name, bucket, transport, rank, nranks = key
        execs = sorted(s[0] for s in samples)
        busbws = sorted(s[1] for s in samples)
        lower = message_size_lower_bytes(samples[0][2]["message_size"])
        win = WindowSummary(
            job=job, host=host, comm=comm, comm_name=comm_name, op=op_name, size_bucket=bucket,
            transport=transport, rank=rank, nranks=nranks, start_ns=start_ns, end_ns=end_ns,
            count=len(samples), bytes=lower * len(samples), exec_ns_min=execs[0],
            exec_ns_p50=nearest_rank(execs, 50), exec_ns_p95=nearest_rank(execs, 95),
            exec_ns_max=execs[-1], busbw_gbs_p50=nearest_rank(busbws, 50),
            first_seq=0, last_seq=0,
        )
        try:
            out.append(_checked(win))
        except InspectorError as e:
            stage = "schema" if e.reason in ("schema", "out_of_range") else "parse"
            bad.append(quarantine(e, repr(sorted(samples[0][2].items())).encode(), source, 0, stage))
    return out, bad
