"""The built-in overlap optimizations, and discovery of plugin ones.

Each optimization lives in its own module here, imports only ``overlapkit.runtime``
and registers itself with ``@register_optimization``. Plugins register the same
way from an installed package (entry-point group ``overlapkit.optimizations``)
or from modules named in the ``OVERLAPKIT_PLUGINS`` environment variable
(comma-separated), which is handy for a project's own optimizations.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

from ..runtime.optimization import REGISTRY, KnobError, Optimization

_BUILTIN_MODULES: tuple[str, ...] = ("checkpoint", "ddp_overlap", "pipeline", "prefetch")
_loaded = False


class PluginError(RuntimeError):
    """A plugin named in ``OVERLAPKIT_PLUGINS`` or by an installed entry point cannot
    be loaded, or takes the name of another optimization."""


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"{__name__}.{module}")
    for entry in entry_points(group="overlapkit.optimizations"):
        package = f" of {entry.dist.name}" if entry.dist is not None else ""
        _plugin(f"the entry point {entry.name} = {entry.value}{package}", entry.load)
    for module in filter(None, os.environ.get("OVERLAPKIT_PLUGINS", "").split(",")):
        name = module.strip()
        _plugin(f"the plugin module {name!r} (OVERLAPKIT_PLUGINS)", importlib.import_module, name)


def _plugin(what: str, load, *args) -> None:  # noqa: ANN001
    try:
        load(*args)
    except Exception as error:  # its own code: whatever it raises, say which plugin
        raise PluginError(f"{what} cannot be loaded: {type(error).__name__}: {error}") from None


def registered_optimizations() -> dict[str, type[Optimization]]:
    """Every known optimization by name, built-ins and plugins."""
    _load()
    return dict(sorted(REGISTRY.items()))


def get_optimization(name: str) -> type[Optimization]:
    available = registered_optimizations()
    if name not in available:
        hint = difflib.get_close_matches(name, list(available), n=1)
        message = f"unknown optimization {name!r}"
        message += f" (did you mean {hint[0]!r}?)" if hint else ""
        allowed = list(available)
        raise KnobError(name, message + f"; available: {', '.join(allowed) or 'none yet'}", allowed)
    return available[name]


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)', re.MULTILINE)


def plugin_blamed(traceback_text: str) -> str | None:
    """The plugin whose code raised, as "module (file:line)", when the innermost frame
    of the traceback that is overlapkit's or a plugin's (an optimization registered
    from a module outside overlapkit) is the plugin's; None: overlapkit's own code."""
    ours = str(Path(__file__).resolve().parent.parent)
    plugins = {}
    for cls in REGISTRY.values():
        module = sys.modules.get(cls.__module__)
        path = getattr(module, "__file__", None)
        if path and not cls.__module__.startswith("overlapkit."):
            plugins[str(Path(path).resolve())] = cls.__module__
    for frame in reversed(list(_FRAME.finditer(traceback_text))):
        path = str(Path(frame["file"]).resolve())
        if path in plugins:
            return f"{plugins[path]} ({frame['file']}:{frame['line']})"
        if path.startswith(ours):
            return None
    return None
