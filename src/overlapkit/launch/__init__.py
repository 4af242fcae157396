"""How ranks start: in this process (one rank), local processes (N ranks), or
under torchrun (its environment says who is who)."""

from .config import WorldConfig

__all__ = ["WorldConfig"]
