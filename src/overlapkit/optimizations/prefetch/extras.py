"""The optional packages the tf.data and DALI back ends need, and the error that
says how to install them."""

from __future__ import annotations

from ...packages import installed

# back end -> (module it imports, package users know, overlapkit extra that installs it)
NEEDS = {
    "tfdata": ("tensorflow", "TensorFlow", "tensorflow"),
    "dali": ("nvidia.dali", "NVIDIA DALI", "dali"),
}


class MissingDependencyError(ImportError):
    """A back end's optional package is not installed."""


def missing(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its package is not installed), or None."""
    if backend not in NEEDS:
        return None
    module, package, extra = NEEDS[backend]
    if installed(module):
        return None
    return (
        f"prefetch backend {backend!r} needs {package}, which is not installed: "
        f"pip install 'overlapkit[{extra}]'"
    )


def require(backend: str) -> None:
    reason = missing(backend)
    if reason:
        raise MissingDependencyError(reason)
