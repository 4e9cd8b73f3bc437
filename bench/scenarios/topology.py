"""Which processes and communicators a scenario job has, for N GPUs and M pretend nodes.

NCCL decides that two ranks are on different nodes by their host hash, which it takes
from ``NCCL_HOSTID`` once per process. Giving ranks on one machine different host ids
therefore forces NCCL's network transport (``NET/Socket``) between GPUs that NVLink
joins. A job that wants both kinds of communicator at once needs processes of two
kinds, because one process has one host id:

* the **host layer**: one process per GPU, all with the same host id. Its communicator
  spans the N GPUs of the machine and stays on NVLink (transport class ``nvlink``).
* the **pretend layer**: one process per GPU, host id ``pretend-node-<j>`` where
  ``j = gpu // (N / M)``. Its communicators are the whole layer (``net`` when each
  pretend node has one GPU, ``mixed`` when it has several), one per pretend node
  (``nvlink``) and one per local index across nodes (``net``, HSDP-like), the last two
  only when a pretend node has at least two GPUs.

The host layer exists when the pretend layer has no NVLink-only communicator of its own
(one GPU per pretend node) or when there is no pretend layer (M = 1); ``host_layer=True``
forces it. Global ranks are ``layer_index * N + gpu``, so torchrun's ``LOCAL_RANK % N``
is the GPU.

Two GPUs, two pretend nodes (what the 2×H200 machine runs): four processes, two per GPU.

>>> t = layout(2, 2)
>>> [(p.rank, p.layer, p.gpu, p.host_id) for p in t.processes]  # doctest: +NORMALIZE_WHITESPACE
[(0, 'host', 0, 'host-0'), (1, 'host', 1, 'host-0'),
 (2, 'pretend', 0, 'pretend-node-0'), (3, 'pretend', 1, 'pretend-node-1')]
>>> [(c.name, c.ranks, c.transport, c.roles) for c in t.comms]
[('host.all', (0, 1), 'nvlink', ('fsdp', 'tp')), ('pretend.all', (2, 3), 'net', ('fsdp', 'tp'))]

Four GPUs, two pretend nodes: one process per GPU and a truly mixed communicator.

>>> t = layout(4, 2)
>>> [(c.name, c.ranks, c.transport, c.roles) for c in t.comms]  # doctest: +NORMALIZE_WHITESPACE
[('pretend.all', (0, 1, 2, 3), 'mixed', ('fsdp',)),
 ('pretend.node0', (0, 1), 'nvlink', ('tp',)), ('pretend.node1', (2, 3), 'nvlink', ('tp',)),
 ('pretend.cross0', (0, 2), 'net', ('dp',)), ('pretend.cross1', (1, 3), 'net', ('dp',))]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

from ncclwatch.rules import transport_class

HOST_LAYER = "host"
PRETEND_LAYER = "pretend"


@dataclass(frozen=True)
class Process:
    """One torchrun process: its global rank, layer, GPU, host id and pretend node."""

    rank: int
    layer: str
    gpu: int
    host_id: str
    node: int  # pretend node index (0 for the host layer)


@dataclass(frozen=True)
class Comm:
    """One NCCL communicator of the job.

    ``roles`` says which collectives a step issues on it: ``fsdp`` (AllGather of
    parameter shards, ReduceScatter of gradients), ``tp`` (AllReduce of activations),
    ``dp`` (one AllReduce of a gradient bucket per step).
    """

    name: str
    ranks: tuple[int, ...]
    layer: str
    nnodes: int
    transport: str
    roles: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    gpus: int
    pretend_nodes: int
    layers: tuple[str, ...]
    processes: tuple[Process, ...]
    comms: tuple[Comm, ...] = field(default_factory=tuple)

    @property
    def world_size(self) -> int:
        return len(self.processes)

    def process(self, rank: int) -> Process:
        return self.processes[rank]

    def comms_of(self, rank: int) -> list[Comm]:
        """The communicators ``rank`` belongs to, in creation order."""
        return [c for c in self.comms if rank in c.ranks]

    def to_dict(self) -> dict:
        return {
            "gpus": self.gpus,
            "pretend_nodes": self.pretend_nodes,
            "layers": list(self.layers),
            "processes": [asdict(p) for p in self.processes],
            "comms": [asdict(c) for c in self.comms],
        }


def layout(gpus: int, pretend_nodes: int, host_layer: bool | None = None) -> Topology:
    """Processes and communicators for ``gpus`` GPUs split into ``pretend_nodes`` nodes.

    ``host_layer=None`` adds the host layer only where it is needed for an NVLink-only
    communicator (see the module docstring).

    >>> layout(8, 8).world_size, layout(8, 2).world_size, layout(8, 2, host_layer=True).world_size
    (16, 8, 16)
    >>> [c.transport for c in layout(2, 1).comms]
    ['nvlink']
    >>> layout(3, 2)
    Traceback (most recent call last):
    ...
    ValueError: --gpus 3 is not a multiple of --pretend-nodes 2
    """
    if gpus < 1 or pretend_nodes < 1:
        raise ValueError(f"need at least one GPU and one node, got {gpus=} {pretend_nodes=}")
    if gpus % pretend_nodes:
        raise ValueError(f"--gpus {gpus} is not a multiple of --pretend-nodes {pretend_nodes}")
    per_node = gpus // pretend_nodes
    if host_layer is None:
        host_layer = pretend_nodes == 1 or per_node == 1
    layers: list[str] = []
    if host_layer:
        layers.append(HOST_LAYER)
    if pretend_nodes > 1:
        layers.append(PRETEND_LAYER)
    if not layers:
        raise ValueError("no layer: one pretend node and no host layer leaves no communicator")

    processes: list[Process] = []
    comms: list[Comm] = []
    for index, layer in enumerate(layers):
        base = index * gpus
        for gpu in range(gpus):
            if layer == HOST_LAYER:
                processes.append(Process(base + gpu, layer, gpu, "host-0", 0))
            else:
                node = gpu // per_node
                processes.append(Process(base + gpu, layer, gpu, f"pretend-node-{node}", node))
        ranks = tuple(range(base, base + gpus))
        nnodes = 1 if layer == HOST_LAYER else pretend_nodes
        if gpus < 2:
            continue  # one GPU: a single-rank communicator moves no data
        if layer == HOST_LAYER or per_node == 1:
            # No smaller NVLink group exists, so TP and FSDP traffic share this communicator.
            comms.append(Comm(f"{layer}.all", ranks, layer, nnodes,
                              transport_class(len(ranks), nnodes), ("fsdp", "tp")))
            continue
        comms.append(Comm(f"{layer}.all", ranks, layer, nnodes,
                          transport_class(len(ranks), nnodes), ("fsdp",)))
        for node in range(pretend_nodes):
            members = tuple(base + node * per_node + i for i in range(per_node))
            comms.append(Comm(f"{layer}.node{node}", members, layer, 1,
                              transport_class(per_node, 1), ("tp",)))
        for local in range(per_node):
            members = tuple(base + node * per_node + local for node in range(pretend_nodes))
            comms.append(Comm(f"{layer}.cross{local}", members, layer, pretend_nodes,
                              transport_class(pretend_nodes, pretend_nodes), ("dp",)))
    return Topology(gpus, pretend_nodes, tuple(layers), tuple(processes), tuple(comms))


def main() -> None:
    parser = argparse.ArgumentParser(description="print a scenario job's layout as JSON")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--pretend-nodes", type=int, required=True)
    parser.add_argument("--host-layer", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    host = {"auto": None, "on": True, "off": False}[args.host_layer]
    print(json.dumps(layout(args.gpus, args.pretend_nodes, host).to_dict(), indent=2))


if __name__ == "__main__":
    main()
