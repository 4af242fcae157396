"""What a run ran on, recorded in every summary so that results from different
machines can be told apart and compared."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NODE_TYPE_ENV = "OVERLAPKIT_NODE_TYPE"  # set by the Ray actor that started this machine's ranks
# The kernel's id of this boot: machines that share a host name (VMs cloned from one
# image) still differ here.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def this_machine() -> str:
    """This machine as ranks tell machines apart: its host name and boot id."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:  # not Linux
        boot = ""
    return f"{socket.gethostname()} {boot}"


def describe_node(device: torch.device) -> dict[str, Any]:
    """This machine as this rank sees it: cores it may use, GPUs, library versions."""
    import torch  # here: the Ray actor that sets NODE_TYPE_ENV imports no torch

    node: dict[str, Any] = {
        "machine": this_machine(),  # (not kept: `nodes_of` groups by it)
        "host": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ray": _version("ray"),
        "device": device.type,
        "node_type": os.environ.get(NODE_TYPE_ENV),  # a Ray cluster's node type, if any
        "gpus": [],
        "nccl": None,
        "gpu_peer_access": None,
    }
    if device.type == "cuda":
        count = torch.cuda.device_count()
        node["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
        node["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        if torch.distributed.is_nccl_available():
            node["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        # The interconnect as far as a process sees it: can each GPU read the others'
        # memory directly (NVLink or PCIe peer-to-peer), or only through the host.
        pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
        node["gpu_peer_access"] = (  # None: one GPU, no pair to ask about
            all(torch.cuda.can_device_access_peer(a, b) for a, b in pairs) if pairs else None
        )
    return node


def nodes_of(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per machine (by `this_machine`), with the ranks that ran there."""
    nodes: dict[str, dict[str, Any]] = {}
    for rank, node in enumerate(per_rank):
        machine = node.get("machine", node["host"])
        entry = nodes.setdefault(machine, {k: v for k, v in node.items() if k != "machine"})
        entry.setdefault("ranks", []).append(rank)
    return list(nodes.values())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def hardware_label(hardware: dict[str, Any] | None) -> str:
    """One line for a run's machines (`summary["hardware"]`): how many, their CPUs
    or GPUs, and the library versions that move the numbers."""
    nodes = (hardware or {}).get("nodes") or []
    if not nodes:
        return "unknown hardware"
    first = nodes[0]
    machines = f"{len(nodes)} machine{'s' if len(nodes) > 1 else ''}"
    if first.get("node_type"):
        machines += f" ({first['node_type']})"
    gpus = [g for n in nodes for g in n.get("gpus") or []]
    if gpus:
        counts = sorted({len(n.get("gpus") or []) for n in nodes})
        per = "/".join(map(str, counts))
        what = f"{per} x {gpus[0]} (sm {first.get('gpu_capability')}) each"
        libs = f"torch {first.get('torch')}, CUDA {first.get('cuda')}, NCCL {first.get('nccl')}"
    else:
        what = f"{first.get('cpu_cores')} cores {first.get('cpu_model')} each"
        libs = f"torch {first.get('torch')}"
    return f"{machines}, {what}; {libs}"
