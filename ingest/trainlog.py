"""Source mapping: a training log's text lines -> ``throughput`` records.

The default pattern reads Megatron-LM's iteration line::

     [2026-11-22 03:01:02.104489] iteration      120/  5000 | consumed samples: 61440 | ...
     | throughput per GPU (TFLOP/s/GPU): 310.2 | ...

and NeMo 2's progress line (``... iteration 9/49 | ... | TFLOPS_per_GPU: 512.3``;
printed without a timestamp, unless its launcher adds one, its time is when it is read).

``config.ingest.throughput_regex`` replaces it; its named group ``tflops`` is required,
``step`` and ``tokens`` are optional.

Megatron prints that figure only with ``--log-throughput`` (off by default). Without it,
the default pattern falls back on the iteration line's ``elapsed time per iteration
(ms)`` and computes TFLOP/s per GPU as Megatron would (:class:`MegatronFlops`), from the
arguments Megatron prints at start; a log with neither gives no throughput.

Without a ``step`` group the step is read from ``iteration <n>`` on the same line, else
counted from 0. Lines that do not match are not errors: a training log is mostly other
text.

Time: a line's own timestamp, when it starts with one (:class:`LineClock`), is when the
iteration was logged; the time the line was read is only the fallback for lines without
one. A log read hours later (a recording, a backlog) otherwise lands its throughput far
from the ops of the same steps, and nothing correlates.

Several ranks' logs are one job series (:class:`RankMerge`).

Megatron's checkpoint saves (``saving checkpoint at iteration N``, ``successfully saved
checkpoint from iteration N``) become ``pause`` records, ``begin`` and ``end``: while a
rank writes, the others wait for it in NCCL, which is not NCCL's trouble
(``detectors/pauses.py``).

>>> p = ThroughputParser(job="j", host="h", timezone="UTC")
>>> r = p.parse("[2026-11-22 03:25:28.104489] iteration 2/ 10 | "
...             "throughput per GPU (TFLOP/s/GPU): 45.7 |", 7)
>>> r.step, r.tflops_per_gpu, r.source, r.rank, r.ts_ns
(2, 45.7, 'log', -1, 1795317928104489000)
>>> p.parse(" iteration 3/ 10 | throughput per GPU (TFLOP/s/GPU): 45.9 |", 7).ts_ns
7
>>> r = p.parse("Training epoch 0, iteration 9/49 | global_step: 9 | train_step_timing in s: 4.395 | "
...             "TFLOPS_per_GPU: 5.123e+02", 8)                   # NeMo 2's progress line
>>> r.step, r.tflops_per_gpu
(9, 512.3)
>>> p.parse("loss 1.23", 8) is None
True
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ncclwatch.config import IngestConfig
from ncclwatch.records import PauseRecord, ThroughputRecord

DEFAULT_REGEX = IngestConfig.throughput_regex
_STEP = re.compile(r"\biteration\s+(\d+)")
_ELAPSED_MS = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_BATCH = re.compile(r"global batch size:\s*(\d+)")
# Megatron-LM's checkpoint saves (rank 0 prints both; timestamped since core_v0.16).
_SAVING = re.compile(r"\bsaving checkpoint at iteration\s+(\d+)")
_SAVED = re.compile(r"\bsuccessfully saved checkpoint from iteration\s+(\d+)")
# Megatron's (and NeMo's) iteration line, with a figure the default pattern reads
_ITERATION_LINE = re.compile(
    rb"\biteration\s+\d+\s*/\s*\d+\s*\|.*(?:throughput per GPU|elapsed time per iteration|TFLOPS_per_GPU)")
# Megatron's ``print_args``: "  hidden_size ........ 4096", after whatever launchers and
# log shippers put before it (``0: [default0]:``, an RFC 3339 stamp); a value may be a list
# with spaces (``moe_layer_freq ..... [0, 0, 1, 1]``)
_ARG = re.compile(r"(?:^|\s)([a-z_][a-z0-9_]*) \.{2,} (\S.*?)\s*$")
_END_OF_ARGS = "end of arguments"
_PADDED_VOCAB = re.compile(r"> padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (\d+)\)")

# A timestamp near the start of a line: Megatron's ``[2026-11-22 03:25:28.104489]``,
# NeMo's ``[NeMo I 2026-11-22 03:25:28 nemo_logging:349]``, Python logging's
# ``2026-11-22 03:25:28,104``, ISO 8601 ``2026-11-22T03:25:28.104Z`` or ``…+01:00``.
# It must begin within the first 32 characters: launchers prefix lines with a rank tag
# (``[default0]:``, ``0: ``), and a date further in is part of the message, not its time.
_STAMP = re.compile(
    r"(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d)[T ](?P<h>\d\d):(?P<mi>\d\d):(?P<s>\d\d)"
    r"(?:[.,](?P<frac>\d{1,9}))?\s?(?P<tz>Z|[+-]\d\d:?\d\d)?(?![\d])"
)
_STAMP_WITHIN = 32


def is_iteration_line(raw: bytes) -> bool:
    """A Megatron / NeMo iteration line that gives the job's throughput (bytes as read).

    >>> is_iteration_line(b" [2026-11-22 03:25:28] iteration      120/    5000 | consumed samples: "
    ...                   b"61440 | elapsed time per iteration (ms): 812.3 | learning rate: 3.0E-04 |")
    True
    >>> is_iteration_line(b"Training epoch 0, iteration 9/49 | lr: 3e-05 | TFLOPS_per_GPU: 512.3")
    True
    >>> is_iteration_line(b"NCCL INFO iteration 3/10 | comm 0x55 rank 0 nRanks 8")
    False
    """
    return b"iteration" in raw and _ITERATION_LINE.search(raw) is not None


def zone(name: str) -> tzinfo | None:
    """The zone a naive timestamp is read in: None for ``local`` (the reader's own zone).

    >>> zone("local") is None, zone("UTC"), str(zone("Europe/Berlin"))
    (True, datetime.timezone.utc, 'Europe/Berlin')
    >>> zone("Mars/Olympus")
    Traceback (most recent call last):
    ...
    ValueError: trainlog_timezone 'Mars/Olympus': not 'local', 'UTC' or an IANA zone name
    """
    if name == "local":
        return None
    if name.upper() in ("UTC", "Z"):
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"trainlog_timezone {name!r}: not 'local', 'UTC' or an IANA zone name") from None


ZONE_STEP_NS = 15 * 60 * 10**9  # every zone's offset is a multiple of a quarter hour
MAX_ZONE_NS = 14 * 3600 * 10**9


def zone_shift_ns(log: tuple[int, int], ops: tuple[int, int]) -> int:
    """The shift of a log's naive timestamps that lays its span ``log`` over the ops'
    ``ops`` (both ``(first, last)`` ns): 0 when they overlap already, else the zone
    offset (a quarter-hour multiple within ±14 h) with the most overlap, 0 if none has.

    A recording replayed in another zone than the one its training log was written in
    reads the log's naive times hours away from the ops of the same steps.

    >>> h = 3600 * 10**9
    >>> zone_shift_ns((10 * h, 10 * h + 60 * 10**9), (10 * h + 5, 11 * h))   # overlap: as read
    0
    >>> zone_shift_ns((15 * h + h // 2, 15 * h + h // 2 + 60 * 10**9), (10 * h, 10 * h + 90 * 10**9)) / h
    -5.5
    >>> zone_shift_ns((40 * h, 40 * h + 60), (10 * h, 10 * h + 60))   # a day away: not a zone
    0
    """
    def overlap(shift: int) -> int:
        return min(log[1] + shift, ops[1]) - max(log[0] + shift, ops[0])

    if overlap(0) >= 0:
        return 0
    best, best_overlap = 0, 0
    for k in range(-(MAX_ZONE_NS // ZONE_STEP_NS), MAX_ZONE_NS // ZONE_STEP_NS + 1):
        shift = k * ZONE_STEP_NS
        o = overlap(shift)
        if o > best_overlap or (o == best_overlap and o > 0 and abs(shift) < abs(best)):
            best, best_overlap = shift, o
    return best


class LineClock:
    """The timestamp a log line starts with, as ns since the epoch (None if it has none).

    A timestamp with an offset (``Z``, ``+01:00``) means what it says. A naive one (what
    Megatron and Python logging print: the training process's local time) is read in
    ``timezone``: ``"local"`` (the zone of the process reading the log, right when it
    runs where the job runs), ``"UTC"``, or an IANA name such as ``"Europe/Berlin"``.

    Parameters
    ----------
    timezone
        The zone of naive timestamps (``config.ingest.trainlog_timezone``).

    Examples
    --------
    >>> c = LineClock("UTC")
    >>> c.time_ns("[2026-11-22 03:25:28.104489] iteration 2/ 10 |")
    1795317928104489000
    >>> c.time_ns("2026-11-22T04:25:28.104489+01:00 iteration 2")
    1795317928104489000
    >>> LineClock("Europe/Berlin").time_ns("[NeMo I 2026-11-22 04:25:28 nemo_logging:349] x")
    1795317928000000000
    >>> c.time_ns("checkpoint saved by the job that started on 2026-11-22 03:25:28") is None
    True
    """

    def __init__(self, timezone: str = "local"):
        self.timezone = timezone
        self._zone = zone(timezone)
        self.naive = 0  # timestamps read without an offset of their own
        self.aware = 0  # ... and with one

    def time_ns(self, line: str) -> int | None:
        m = _STAMP.search(line, 0, _STAMP_WITHIN + 40)
        if m is None or m.start() > _STAMP_WITHIN:
            return None
        g = m.group
        try:
            dt = datetime(int(g("y")), int(g("mo")), int(g("d")), int(g("h")), int(g("mi")), int(g("s")))
        except ValueError:
            return None  # 2026-13-45: not a date
        tz = g("tz")
        if tz:
            self.aware += 1
            if tz == "Z":
                dt = dt.replace(tzinfo=UTC)
            else:
                sign = -1 if tz[0] == "-" else 1
                hh, mm = int(tz[1:3]), int(tz[-2:])
                dt = dt.replace(tzinfo=timezone(sign * timedelta(hours=hh, minutes=mm)))
        else:
            self.naive += 1
            if self._zone is not None:
                dt = dt.replace(tzinfo=self._zone)
        # A naive datetime's timestamp() is the local zone's, which is what "local" means.
        frac = g("frac") or ""
        return int(dt.timestamp()) * 10**9 + int((frac + "000000000")[:9])


class MegatronFlops:
    """TFLOP/s per GPU from an iteration time, as Megatron computes them.

    Megatron's ``training_log`` divides ``num_floating_point_operations(args, global
    batch)`` by the iteration time and the world size; this reads the arguments it
    printed at start (``print_args``: one ``name ..... value`` line each, and its
    ``> padded vocab`` line) and does the same for the GPT formula: attention with grouped
    queries, (Swi)GLU MLP, routed and shared experts, logits. Megatron changed that
    formula in core_v0.12 (causal attention counted half, experts of
    ``moe_ffn_hidden_size``, dense and MoE layers from ``moe_layer_freq``, multi-token
    prediction layers; an output gate since core_v0.16); the arguments of those versions
    include ``mtp_num_layers``, so a log that prints it is computed the new way, any
    other the old. Newer model kinds (multi-latent attention, hybrid Mamba, linear
    attention) and packed sequences are counted as that formula would; their absolute
    figure may then differ from Megatron's own, but a run's series stays proportional to
    its iterations per second, which is all the detectors compare. Several ranks' logs of
    one job share one instance: the arguments are in rank 0's log, the iteration lines
    in the last rank's.

    >>> m = MegatronFlops()
    >>> for line in ["  hidden_size ..... 4096", "[default0]:  num_layers ....... 32",
    ...              "  num_attention_heads ..... 32", "  seq_length ..... 4096",
    ...              "  ffn_hidden_size ..... 11008", "  swiglu ..... True",
    ...              "  world_size ..... 64", " > padded vocab (size: 32000) with 0 dummy tokens (new size: 32000)"]:
    ...     _ = m.read(line)
    >>> round(m.tflops(iteration_ms=12_000.0, global_batch=512), 1)  # Llama-2-7B-like, Megatron < 0.12
    125.8
    >>> _ = m.read("0: [default0]:  mtp_num_layers .............. None")   # core_v0.12 or later
    >>> round(m.tflops(iteration_ms=12_000.0, global_batch=512), 1)  # attention's s^2 term halved
    117.0
    >>> MegatronFlops().tflops(iteration_ms=100.0, global_batch=8) is None  # no arguments seen
    True
    """

    NEEDED = ("hidden_size", "num_layers", "num_attention_heads", "seq_length", "world_size")

    def __init__(self) -> None:
        self.args: dict[str, str] = {}
        self.ended = False  # its "end of arguments" line was read

    def read(self, line: str) -> bool:
        """Remember the argument this line prints; False if it prints none."""
        if "..." in line:
            m = _ARG.search(line)
            if m is not None:
                self.args[m.group(1)] = m.group(2)
                return True
        elif "padded vocab" in line:
            m = _PADDED_VOCAB.search(line)
            if m is not None:
                self.args["padded_vocab_size"] = m.group(1)
                return True
        elif _END_OF_ARGS in line:
            self.ended = True
        return False

    @property
    def complete(self) -> bool:
        """Every argument it will print was read (the vocabulary's size comes last)."""
        return self.ended and "padded_vocab_size" in self.args

    def _num(self, name: str, default: float | None = None) -> float | None:
        v = self.args.get(name)
        try:
            x = float(v) if v is not None and v != "None" else default
        except ValueError:
            return default
        return x if x is None or (math.isfinite(x) and x >= 0) else default

    def _flag(self, name: str) -> bool:
        return self.args.get(name) == "True"

    def _moe_layers(self, layers: int) -> list[int]:
        """Which layers have experts (1) or a dense MLP (0): ``moe_layer_freq`` printed as
        an interval (every n-th layer, from the first) or as the list itself."""
        v = (self.args.get("moe_layer_freq") or "1").strip()
        if v.startswith("["):
            try:
                pattern = [int(x) for x in v.strip("[]").split(",")]
            except ValueError:
                pattern = []
            if len(pattern) == layers and set(pattern) <= {0, 1}:
                return pattern
            return [1] * layers  # not a list Megatron would accept: every layer, as before 0.12
        every = int(self._num("moe_layer_freq") or 1) or 1
        return [1 if i % every == 0 else 0 for i in range(layers)]

    def flops(self, global_batch: int) -> float | None:
        """Model FLOPs of one iteration of ``global_batch`` sequences (forward and back)."""
        h, layers, heads, seq, _ = (self._num(k) for k in self.NEEDED)
        if not (h and layers and heads and seq):
            return None
        kv = self._num("kv_channels") or h / heads
        groups = self._num("num_query_groups") if self._flag("group_query_attention") else None
        groups = groups or heads
        moe = self._num("num_experts") is not None
        topk = (self._num("moe_router_topk") or 1.0) if moe else 0.0
        ffn = self._num("ffn_hidden_size") or 4 * h
        shared = self._num("moe_shared_expert_intermediate_size") or 0.0
        vocab = self._num("padded_vocab_size") or 0.0  # unknown: no logit term (a constant)
        if "mtp_num_layers" not in self.args:  # Megatron before core_v0.12
            glu = 1.5 if self._flag("swiglu") else 1.0
            attention = (1 + groups / heads + seq / h) * (kv * heads / h)
            mlp = ffn / h * (topk if moe else 1.0) * glu + shared / h * glu
            return 12 * global_batch * seq * layers * h * h * (attention + mlp + vocab / (2 * layers * h))
        # core_v0.12 on: per token, 6 (forward and backward, multiply-add) x each GEMM's size
        glu = 3.0 if self._flag("swiglu") else 2.0  # GEMMs of the MLP
        pattern = self._moe_layers(int(layers)) if moe else [0] * int(layers)
        mtp = self._num("mtp_num_layers") or 0.0
        moe_layers = sum(pattern) + pattern[-1] * mtp  # prediction layers are like the last
        dense_layers = layers + mtp - moe_layers
        expert_ffn = self._num("moe_ffn_hidden_size") or ffn
        q, kvp = kv * heads, kv * groups
        gate = q if self._flag("attention_output_gate") else 0.0
        per_token = (6 * h * (ffn * glu * dense_layers + (expert_ffn * topk + shared) * glu * moe_layers)
                     + (6 * (h * (q + 2 * kvp + gate) + q * h) + 6 * q * seq) * (layers + mtp)
                     + 6 * mtp * (3 * h + 2 * h * h)
                     + 6 * h * vocab * (mtp + 1))
        return global_batch * seq * per_token

    def tflops(self, iteration_ms: float, global_batch: int | None) -> float | None:
        """TFLOP/s per GPU for an iteration of ``iteration_ms``; None until the arguments
        it needs were read (the batch: the line's, else ``global_batch_size``)."""
        batch = global_batch or self._num("global_batch_size")
        world = self._num("world_size")
        flops = self.flops(int(batch)) if batch else None
        if flops is None or not world or not iteration_ms > 0:
            return None
        return flops / (iteration_ms / 1000.0 * 1e12 * world)


class ThroughputParser:
    """Turn matching log lines into throughput records.

    Parameters
    ----------
    job, host
        Labels of the records (the log carries neither).
    regex
        Pattern with a ``tflops`` group (optional ``step``, ``tokens``).
    timezone
        The zone of naive line timestamps (see :class:`LineClock`).
    megatron
        Where Megatron's printed arguments are kept, shared by the parsers of one job's
        logs (default: one of its own). Used with the default pattern only: a custom
        one says exactly which lines count.
    """

    def __init__(self, *, job: str, host: str, regex: str = DEFAULT_REGEX, timezone: str = "local",
                 megatron: MegatronFlops | None = None):
        self.job = job
        self.host = host
        self.regex = regex
        self.timezone = timezone
        self._pattern = re.compile(regex)
        if "tflops" not in self._pattern.groupindex:
            raise ValueError(f"throughput regex needs a (?P<tflops>...) group: {regex!r}")
        self.megatron = (megatron if megatron is not None else MegatronFlops()) if regex == DEFAULT_REGEX else None
        self._clock = LineClock(timezone)
        self._next_step = 0
        self.untimed = 0  # records stamped with the read time: their line had no timestamp
        self.clock = self._clock  # its counts of naive and zoned timestamps
        self.computed = 0  # records whose TFLOP/s were computed from the iteration time

    def parse(self, line: str, read_ns: int) -> ThroughputRecord | PauseRecord | None:
        """The line's record, stamped with its own time, else ``read_ns``; None if none.

        >>> p = ThroughputParser(job="j", host="h", timezone="UTC")
        >>> r = p.parse("[2026-12-07 11:00:05.5] saving checkpoint at iteration      40 to /ck "
        ...             "in torch format", 0)
        >>> r.KIND, r.state, r.step, r.ts_ns % 10**10
        ('pause', 'begin', 40, 5500000000)
        >>> p.parse("  [2026-12-07 11:00:13.0] successfully saved checkpoint from iteration      40 "
        ...         "to /ck [ t 1/1, p 1/1 ]", 0).state
        'end'
        """
        if self.megatron is not None and "checkpoint" in line:
            pause = self._pause(line, read_ns)
            if pause is not None:
                return pause
        m = self._pattern.search(line)
        groups: dict[str, str | None] = {}
        if m is not None:
            groups = m.groupdict()
            try:
                tflops = float(groups["tflops"] or "")
            except ValueError:
                return None
        else:
            computed = self._from_iteration_time(line)
            if computed is None:
                return None
            tflops = computed
        if not math.isfinite(tflops) or tflops < 0:
            return None
        step = None
        if groups.get("step"):
            step = int(groups["step"])
        else:
            s = _STEP.search(line)
            if s:
                step = int(s.group(1))
        if step is None:
            step = self._next_step
        self._next_step = step + 1
        tokens = None
        if groups.get("tokens"):
            try:
                tokens = float(groups["tokens"])
            except ValueError:
                tokens = None
            if tokens is not None and (not math.isfinite(tokens) or tokens < 0):
                tokens = None
        ts_ns = self._clock.time_ns(line)
        if ts_ns is None:
            ts_ns = read_ns
            self.untimed += 1
        return ThroughputRecord(
            job=self.job,
            host=self.host,
            rank=-1,
            ts_ns=ts_ns,
            step=step,
            tflops_per_gpu=tflops,
            tokens_per_s=tokens,
            source="log",
        )

    def _pause(self, line: str, read_ns: int) -> PauseRecord | None:
        m = _SAVING.search(line)
        state = "begin"
        if m is None:
            m = _SAVED.search(line)
            state = "end"
            if m is None:
                return None
        ts_ns = self._clock.time_ns(line)
        if ts_ns is None:  # Megatron before core_v0.16: live, the read time is close
            ts_ns = read_ns
            self.untimed += 1
        return PauseRecord(job=self.job, host=self.host, rank=-1, ts_ns=ts_ns, state=state,
                           reason="checkpoint", step=int(m.group(1)))

    def _from_iteration_time(self, line: str) -> float | None:
        """Megatron's iteration line without its TFLOP/s: computed from the iteration time
        (:class:`MegatronFlops`); other lines may print an argument, remembered."""
        if self.megatron is None:
            return None
        m = _ELAPSED_MS.search(line)
        if m is None or _STEP.search(line) is None:
            self.megatron.read(line)
            return None
        b = _BATCH.search(line)
        try:
            tflops = self.megatron.tflops(float(m.group(1)), int(b.group(1)) if b else None)
        except ValueError:
            return None
        if tflops is not None:
            self.computed += 1
        return tflops


SKEW_NS = 10**9  # the most the ranks' reports of one iteration are apart in time


class RankMerge:
    """Several ranks' training logs (one file per rank) -> one job throughput series.

    The rule: per iteration, the **median** over the ranks that reported it, stamped at
    the **latest** of their timestamps. Ranks of a data-parallel job step together, so
    their per-iteration TFLOP/s agree up to when each printed; the median is that common
    value and ignores one rank whose line is off (a stalled logger, a rank that prints
    a partial figure). The iteration is over for the job only once its last rank is
    done, and the ops of that iteration end before it: the latest timestamp never puts
    the job's throughput ahead of the NCCL windows that explain it. Ranks that print no
    iteration lines (Megatron prints on one rank per pipeline stage) do not count.

    An iteration is the k-th report of step n by a source, so a job restarted from a
    checkpoint, which logs steps again, gives new iterations rather than mixing its
    second run into its first.

    Records go in with :meth:`add` and come out with :meth:`release`, so a caller adds
    everything one poll read from every file before deciding what is complete. Live, an
    iteration goes out once every rank that has reported anything reported it, or once a
    later report is ``hold_s`` newer than it (a rank that died must not hold the job's
    series back; counted in time, not iterations, because ranks' logs are flushed and
    read at their own pace, many short iterations apart); a rank's report of an
    iteration already sent is counted in ``late`` and dropped. ``hold_s=None`` (a
    recording, read whole) holds everything for :meth:`flush`.

    Parameters
    ----------
    hold_s
        How much newer a later report must be before an incomplete iteration is sent
        anyway; None: never.

    Examples
    --------
    >>> def rec(step, tf, ts):
    ...     return ThroughputRecord(job="j", host="h", rank=-1, ts_ns=ts, step=step,
    ...                             tflops_per_gpu=tf, tokens_per_s=None, source="log")
    >>> m = RankMerge(hold_s=1e-7)
    >>> m.add("rank-0.log", rec(1, 40.0, 100)); m.add("rank-1.log", rec(1, 44.0, 130))
    >>> [(r.step, r.tflops_per_gpu, r.ts_ns) for r in m.release()]
    [(1, 42.0, 130)]
    >>> m.add("rank-0.log", rec(2, 40.0, 200)); m.release()  # rank 1 has not logged it yet
    []
    >>> m.add("rank-1.log", rec(2, 44.0, 230)); [r.tflops_per_gpu for r in m.release()]
    [42.0]
    >>> m.add("rank-0.log", rec(3, 40.0, 300)); m.add("rank-0.log", rec(4, 40.0, 401))
    >>> [(r.step, r.tflops_per_gpu) for r in m.release()]  # rank 1 silent 100 ns too long
    [(3, 40.0)]
    """

    def __init__(self, hold_s: float | None = 5.0):
        if hold_s is not None and not hold_s > 0:
            raise ValueError(f"hold_s must be > 0 or None, got {hold_s}")
        self.hold_s = hold_s
        self._hold_ns = None if hold_s is None else int(hold_s * 1e9)
        self._newest_ns = -1
        self._sources: set[str] = set()
        self._seen: dict[tuple[str, int], int] = {}  # (source, step) -> reports so far
        self._pending: dict[tuple[int, int], dict[str, ThroughputRecord]] = {}
        self._order: deque[tuple[int, int]] = deque()
        self._sent: set[tuple[int, int]] = set()
        self._sent_order: deque[tuple[int, int]] = deque()
        self._pauses: list[PauseRecord] = []
        self.late = 0

    def add(self, source: str, record: ThroughputRecord | PauseRecord) -> None:
        """One rank's record (one line of its log). A pause goes out with the next
        release whatever is held: it says what the job does now."""
        if record.KIND == "pause":
            self._pauses.append(record)
            return
        self._sources.add(source)
        if record.ts_ns > self._newest_ns:
            self._newest_ns = record.ts_ns
        n = self._seen.get((source, record.step), 0)
        self._seen[(source, record.step)] = n + 1
        key = (record.step, n)
        if key in self._sent:
            self.late += 1
            return
        group = self._pending.get(key)
        if group is None:
            group = self._pending[key] = {}
            self._order.append(key)
        group.setdefault(source, record)

    @property
    def sources(self) -> frozenset[str]:
        """The logs iterations wait for."""
        return frozenset(self._sources)

    def expect(self, source: str) -> None:
        """A log that will report: iterations wait for it from now on (a reader that
        opened several logs says so before it read any of them)."""
        self._sources.add(source)

    def release(self, until_ns: int | None = None) -> list[ThroughputRecord | PauseRecord]:
        """The job records of the iterations complete now, in iteration order.

        ``until_ns``: every log was read up to this time, so an iteration reported more
        than ``SKEW_NS`` before it is complete whoever did not report it (the ranks of
        one iteration print within that of each other; a later report counts as late).
        """
        return self._release(final=False, until_ns=until_ns)

    def flush(self) -> list[ThroughputRecord | PauseRecord]:
        """Every iteration still held, with the ranks that reported it."""
        return self._release(final=True)

    def _release(self, final: bool, until_ns: int | None = None) -> list[ThroughputRecord | PauseRecord]:
        out: list[ThroughputRecord | PauseRecord] = []
        while self._order:
            key = self._order[0]
            group = self._pending[key]
            if not final and (self._hold_ns is None or (
                    len(group) < len(self._sources)
                    and self._newest_ns - min(r.ts_ns for r in group.values()) < self._hold_ns
                    and (until_ns is None
                         or max(r.ts_ns for r in group.values()) + SKEW_NS >= until_ns))):
                break
            self._order.popleft()
            del self._pending[key]
            out.append(_combine(list(group.values())))
            self._sent.add(key)
            self._sent_order.append(key)
            if len(self._sent_order) > 4096:  # a late report is never this late
                self._sent.discard(self._sent_order.popleft())
        if self._pauses:
            out += self._pauses
            self._pauses = []
            out.sort(key=lambda r: r.ts_ns)  # one series in time order
        return out


class RankLogs:
    """One job's training logs as they grow, one per rank: a parser per log (the
    arguments rank 0's log printed serve every log's, :class:`MegatronFlops`) and the
    ranks merged into the job's series (:class:`RankMerge`, live: ``hold_s``). The
    forwarder and ``watch``'s live sources read training logs through it.

    ``expect_new``: a log counts for the merge from its first line read, before it
    reported an iteration (a reader that reads all logs up to a common time, as the
    forwarder does, knows then that a silent rank has nothing yet).

    >>> logs = RankLogs(job="j", host="h", timezone="UTC")
    >>> line = b"[2026-11-22 03:25:28] iteration 2/ 10 | throughput per GPU (TFLOP/s/GPU): %.1f |"
    >>> logs.add(line % 40.0, "rank-0.log", 7).tflops_per_gpu
    40.0
    >>> _ = logs.add(line % 44.0, "rank-1.log", 7)
    >>> [(r.step, r.tflops_per_gpu) for r in logs.merge.release()]
    [(2, 42.0)]
    """

    def __init__(self, *, job: str, host: str, regex: str = DEFAULT_REGEX, timezone: str = "local",
                 expect_new: bool = False):
        self.job, self.host, self.regex, self.timezone = job, host, regex, timezone
        self.expect_new = expect_new
        ThroughputParser(job=job, host=host, regex=regex)  # a bad regex fails here, not at a line
        self.merge = RankMerge()
        self.megatron = MegatronFlops()
        self._parsers: dict[str, ThroughputParser] = {}

    def parser(self, source: str) -> ThroughputParser:
        """The parser of one log (made at its first line)."""
        parser = self._parsers.get(source)
        if parser is None:
            parser = self._parsers[source] = ThroughputParser(
                job=self.job, host=self.host, regex=self.regex, timezone=self.timezone,
                megatron=self.megatron)
            if self.expect_new:
                self.merge.expect(source)
        return parser

    def add(self, raw: bytes, source: str, read_ns: int) -> ThroughputRecord | PauseRecord | None:
        """One line of one log: its record (also in the merge), or None."""
        rec = self.parser(source).parse(raw.decode("utf-8", errors="replace"), read_ns)
        if rec is not None:
            self.merge.add(source, rec)
        return rec


def _combine(records: list[ThroughputRecord]) -> ThroughputRecord:
    first = records[0]
    if len(records) == 1:
        return first
    tokens = [r.tokens_per_s for r in records if r.tokens_per_s is not None]
    return ThroughputRecord(
        job=first.job,
        host=first.host,
        rank=-1,
        ts_ns=max(r.ts_ns for r in records),
        step=first.step,
        tflops_per_gpu=statistics.median(r.tflops_per_gpu for r in records),
        tokens_per_s=statistics.median(tokens) if tokens else None,
        source=first.source,
    )
