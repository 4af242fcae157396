"""What a GPU set-up can run, checked before any rank starts.

Each rule is a plain function of what was found (device count, compute
capability, the torch build's arch list), so it is tested without a GPU;
`check_gpu_setup` reads those facts from torch and applies them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Volta (7.0) kernels ship only in torch's CUDA 12.6 builds (2.11 on; CUDA 12.8
# builds dropped them in 2.8-2.9 and again from 2.11, CUDA 13 never had them).
VOLTA_BUILD_HINT = "for a V100 (7.0) install a torch build for CUDA 12.6 (cu126)"


class GPUSetupError(ValueError):
    """This machine's GPUs or torch build cannot run the scenario as asked."""


@dataclass(frozen=True)
class GPUFacts:
    """What torch sees of this machine's GPUs."""

    count: int
    name: str = ""
    capability: tuple[int, int] = (0, 0)
    arch_list: tuple[str, ...] = ()

    @classmethod
    def probe(cls) -> GPUFacts:
        if not torch.cuda.is_available():
            return cls(0)
        return cls(
            torch.cuda.device_count(),
            torch.cuda.get_device_name(0),
            torch.cuda.get_device_capability(0),
            tuple(torch.cuda.get_arch_list()),
        )


def check_rank_count(local_ranks: int, gpus: int) -> None:
    """One GPU per rank: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"),
    and sharing one under gloo measures two ranks fighting over it."""
    if local_ranks > gpus:
        raise GPUSetupError(
            f"{local_ranks} ranks on this machine but {gpus} visible GPU(s): each rank needs "
            f"its own; set world.nprocs to at most {gpus} (or world.device: cpu)"
        )


def check_precision(precision: str, capability: tuple[int, int], name: str = "this GPU") -> None:
    """bf16 needs compute capability 8.0 (Ampere): below, torch emulates it, slowly
    and without tensor cores, and says nothing."""
    if precision == "bf16" and capability < (8, 0):
        major, minor = capability
        raise GPUSetupError(
            f"train.precision bf16 needs a GPU of compute capability 8.0 or more; {name} "
            f"has {major}.{minor}: use fp16 (with its grad scaler) or fp32"
        )


def build_has_kernels(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """True when the build runs on a GPU of ``capability``: a cubin for the same major
    version and a minor at or below it, or PTX for an older or equal one (compiled
    at load time); arch-specific ones (``sm_90a``, ``compute_90a``) run on exactly
    that capability, family-specific ones (``compute_100f``) on that major only."""
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        digits = number.rstrip("abf")
        if not digits.isdigit():
            continue
        arch_major, arch_minor = int(digits[:-1]), int(digits[-1])
        if number.endswith("a") and (arch_major, arch_minor) != capability:
            continue  # arch-specific (cubin or PTX): that capability only
        if number.endswith("f") and arch_major != major:
            continue  # family-specific: that major version only
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= capability:
            return True
    return False


def check_build(facts: GPUFacts) -> None:
    if facts.count and facts.arch_list and not build_has_kernels(facts.capability, facts.arch_list):
        major, minor = facts.capability
        hint = f"; {VOLTA_BUILD_HINT}" if facts.capability[0] == 7 else ""
        raise GPUSetupError(
            f"this torch build ({torch.__version__}) has no kernels for {facts.name or 'the GPU'} "
            f"(compute capability {major}.{minor}): it was built for {', '.join(facts.arch_list)}"
            f"{hint}"
        )


def check_cpu_setup(precision: str, backend: str) -> None:
    """What a run on CPUs cannot do: fp16's grad scaler and NCCL are for GPUs only."""
    if precision == "fp16":
        raise GPUSetupError(
            "train.precision fp16 is for GPUs only (its grad scaler); this run is on the "
            "CPU (no CUDA device, or world.device cpu): use bf16 (autocast) or fp32"
        )
    if backend == "nccl":
        raise GPUSetupError(
            "world.backend nccl is for GPUs only (NCCL carries CUDA tensors); this run is on "
            "the CPU (no CUDA device, or world.device cpu): use gloo, or auto"
        )


def check_gpu_setup(local_ranks: int, precision: str, facts: GPUFacts | None = None) -> None:
    """Every rule, for ``local_ranks`` ranks on this machine: raises `GPUSetupError`."""
    facts = facts or GPUFacts.probe()
    if facts.count == 0:
        raise GPUSetupError("world.device is cuda but no CUDA device is visible")
    check_rank_count(local_ranks, facts.count)
    check_build(facts)
    check_precision(precision, facts.capability, facts.name or "the GPU")
