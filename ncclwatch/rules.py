"""The shared rules: size buckets, bandwidth factors, transport classes, record ids.

This module is the one place in Python where these rules live; the C plugin mirrors
them in ``plugin/src/rules.c`` and ``tests/vectors/rules.json`` holds the vectors both
sides are tested against.

>>> size_bucket(3 * 1024 * 1024)
'2MiB'
>>> inspector_size_label(3 * 1024 * 1024)
'3-4MB'
>>> bus_factor("AllReduce", 8)
1.75
>>> transport_class(nranks=16, nnodes=2)
'mixed'
"""

from __future__ import annotations

import re

TRANSPORTS = ("single", "nvlink", "net", "mixed")
# Transport classes whose traffic crosses the network; `nvlink` stays inside a node.
NETWORK_TRANSPORTS = frozenset({"net", "mixed"})

DTYPE_BYTES: dict[str, int] = {
    "ncclInt8": 1,
    "ncclChar": 1,
    "ncclUint8": 1,
    "ncclInt32": 4,
    "ncclInt": 4,
    "ncclUint32": 4,
    "ncclInt64": 8,
    "ncclUint64": 8,
    "ncclFloat16": 2,
    "ncclHalf": 2,
    "ncclFloat32": 4,
    "ncclFloat": 4,
    "ncclFloat64": 8,
    "ncclDouble": 8,
    "ncclBfloat16": 2,
    "ncclFloat8e4m3": 1,
    "ncclFloat8e5m2": 1,
}

_BUCKET_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_INSPECTOR_UNITS = ("B", "KB", "MB", "GB", "TB")


def transport_class(nranks: int, nnodes: int) -> str:
    """Classify a communicator by how its traffic travels.

    ``single``: one rank, no traffic. ``nvlink``: every rank on one node.
    ``net``: one rank per node, so every hop is a network hop. ``mixed``: several
    nodes with several ranks each, so traffic crosses both NVLink and the network.

    >>> [transport_class(1, 1), transport_class(8, 1), transport_class(4, 4), transport_class(4, 2)]
    ['single', 'nvlink', 'net', 'mixed']
    """
    if nranks < 1 or nnodes < 1:
        raise ValueError(f"nranks and nnodes must be >= 1, got {nranks=} {nnodes=}")
    if nranks == 1:
        return "single"
    if nnodes == 1:
        return "nvlink"
    if nnodes >= nranks:
        return "net"
    return "mixed"


def local_ranks(nranks: int, nnodes: int) -> int:
    """Ranks per node, rounded up.

    >>> local_ranks(16, 2), local_ranks(3, 2)
    (8, 2)
    """
    return -(-nranks // max(nnodes, 1))


def message_bytes(count: int, dtype: str) -> int:
    """Message size of ``count`` elements of NCCL datatype ``dtype``.

    >>> message_bytes(1024, "ncclBfloat16")
    2048
    """
    try:
        return count * DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown NCCL datatype {dtype!r}") from None


GATHERS = ("AllGather", "AllGatherV", "ReduceScatter")  # described by the per-rank count


def traffic_bytes(op: str, msg_bytes: int, nranks: int) -> int:
    """Bytes an op moves per rank in nccl-tests' convention (the algbw numerator).

    AllGather (and its ``V`` form, as NCCL Inspector counts it) and ReduceScatter are
    described by the per-rank count, so their traffic is the message times the
    communicator size.

    >>> traffic_bytes("AllGather", 1000, 4), traffic_bytes("AllReduce", 1000, 4)
    (4000, 1000)
    """
    if op in GATHERS:
        return msg_bytes * nranks
    return msg_bytes


def bus_factor(op: str, nranks: int) -> float:
    """busbw / algbw for an op on ``nranks`` ranks (nccl-tests' convention).

    >>> bus_factor("AllReduce", 2), bus_factor("AllGather", 4), bus_factor("Send", 2)
    (1.0, 0.75, 1.0)
    """
    if nranks <= 1:
        return 1.0 if op not in ("AllReduce", *GATHERS, "AllToAll") else 0.0
    if op == "AllReduce":
        return 2.0 * (nranks - 1) / nranks
    if op in GATHERS or op == "AllToAll":
        return (nranks - 1) / nranks
    return 1.0


def bandwidths_gbs(op: str, msg_bytes: int, nranks: int, exec_ns: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s; both 0 when the op took no measurable time.

    Bytes per nanosecond are GB/s (10^9 bytes per second).

    >>> bandwidths_gbs("AllReduce", 1_000_000, 2, 10_000)
    (100.0, 100.0)
    """
    if exec_ns <= 0:
        return 0.0, 0.0
    algbw = traffic_bytes(op, msg_bytes, nranks) / exec_ns
    return algbw, algbw * bus_factor(op, nranks)


def size_bucket_exponent(nbytes: int) -> int:
    """log2 of the power of two at or below ``nbytes``; -1 for 0 bytes.

    >>> size_bucket_exponent(1), size_bucket_exponent(1023), size_bucket_exponent(1024)
    (0, 9, 10)
    """
    if nbytes < 0:
        raise ValueError(f"negative size {nbytes}")
    return nbytes.bit_length() - 1


def size_bucket(nbytes: int) -> str:
    """Baseline bucket label: the power of two at or below the size.

    >>> [size_bucket(n) for n in (0, 1, 1000, 1024, 1536, 1 << 30, 3 << 20)]
    ['0B', '1B', '512B', '1KiB', '1KiB', '1GiB', '2MiB']
    """
    e = size_bucket_exponent(nbytes)
    if e < 0:
        return "0B"
    unit = min(e // 10, len(_BUCKET_UNITS) - 1)
    return f"{1 << (e - 10 * unit)}{_BUCKET_UNITS[unit]}"


def size_bucket_bytes(label: str) -> int:
    """Inverse of :func:`size_bucket`: the lower bound in bytes.

    >>> size_bucket_bytes("2MiB"), size_bucket_bytes("0B")
    (2097152, 0)
    """
    m = re.fullmatch(r"(\d+)(B|KiB|MiB|GiB|TiB|PiB)", label)
    if not m:
        raise ValueError(f"not a size bucket: {label!r}")
    return int(m.group(1)) << (10 * _BUCKET_UNITS.index(m.group(2)))


# Messages from this size on take their time moving bytes, not waiting on latency: a
# link that loses bandwidth slows them. A key of smaller ones (a loss or grad-norm
# all-reduce of a few bytes) holding steady says nothing about a link's bandwidth.
BANDWIDTH_BOUND_BYTES = 1 << 20


def bandwidth_bound(bucket: str) -> bool:
    """Whether a key of this size bucket would feel a link losing bandwidth.

    >>> bandwidth_bound("512MiB"), bandwidth_bound("1MiB"), bandwidth_bound("8B")
    (True, True, False)
    """
    return size_bucket_bytes(bucket) >= BANDWIDTH_BOUND_BYTES


def inspector_size_label(nbytes: int) -> str:
    """NCCL Inspector's ``message_size`` label: ``"<n>-<n+1><unit>"``.

    Divide by 1024 while the value is at least 1024, then floor. Inspector writes a
    zero-byte op as plain ``"0B"``.

    >>> [inspector_size_label(n) for n in (0, 1023, 1024, 1536, 8 << 20)]
    ['0B', '1023-1024B', '1-2KB', '1-2KB', '8-9MB']
    """
    if nbytes == 0:
        return "0B"
    value = float(nbytes)
    unit = 0
    while value >= 1024 and unit < len(_INSPECTOR_UNITS) - 1:
        value /= 1024
        unit += 1
    n = int(value)
    return f"{n}-{n + 1}{_INSPECTOR_UNITS[unit]}"


_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    """64-bit FNV-1a hash.

    >>> hex(fnv1a64(b"a"))
    '0xaf63dc4c8601ec8c'
    """
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _MASK64
    return h


def record_id(job: str, host: str, pid: int, comm: str, rank: int, op: str, peer: int, seq: int) -> str:
    """Stable id of one op on one rank: the same op re-read after a crash gets the same id.

    >>> record_id("j", "h", 1, "0x0000000000000001", 0, "AllReduce", -1, 7)
    '...'
    """
    key = "\x1f".join((job, host, str(pid), comm, str(rank), op, str(peer), str(seq)))
    return f"{fnv1a64(key.encode('utf-8')):016x}"


def comm_hex(comm_hash: int) -> str:
    """Communicator hash as the contract spells it.

    >>> comm_hex(255)
    '0x00000000000000ff'
    """
    return f"0x{comm_hash & _MASK64:016x}"


_SAFE = re.compile(r"[^A-Za-z0-9_-]")


def safe_filename(name: str, max_len: int = 128) -> str:
    """Escape a user-given name (job id, host) into one safe path component.

    Bytes outside ``[A-Za-z0-9_-]`` become ``%XX``, so distinct names stay distinct and
    nothing can climb out of a directory.

    >>> safe_filename("../job 7/a.b")
    '%2E%2E%2Fjob%207%2Fa%2Eb'
    >>> safe_filename("")
    '%00'
    """
    if not name:
        return "%00"
    out = _SAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode("utf-8")), name)
    return out[:max_len]
