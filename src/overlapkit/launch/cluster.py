"""``overlapkit cluster check``: a Ray cluster-launcher config, validated offline.

Ray's own schema and config preparation come first (unknown keys, fractional
resources, a head type that does not exist). Then what Ray does not check
and a study on GPU VMs needs, each broken rule reported with its node type
and key:

- a node type with GPUs must not live-migrate (GCP: ``onHostMaintenance: TERMINATE``);
- V100s attach only to N1 machines;
- ``resources.GPU`` equals the accelerators attached (the GCP provider fills in nothing);
- resources are whole numbers;
- each accelerator has a type and a positive count;
- a node type's ``min_workers`` and ``max_workers`` are not negative, min no more than max;
- on GCP, ``provider.project_id`` is set, and not to the shipped placeholder, and
  ``provider.availability_zone`` lies in ``provider.region``;
- Ray and overlapkit are pinned in the setup commands (the driver's Ray must be
  the cluster's, and every node must run the same overlapkit);
- the study storage is one the workers can reach (a database server on the
  network, not a file or localhost).

Nothing here talks to a cloud: no credentials are needed.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Providers whose nodes all run on this one machine: setup and storage rules do not apply.
ONE_MACHINE = ("fake_multinode", "local")
STORAGE_VARIABLE = "OVERLAPKIT_STORAGE"
# A GCP project ID, with the domain of a (legacy) domain-scoped project: example.com:my-project.
PROJECT_ID = r"(?:[a-z0-9.-]+\.[a-z]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]"
COMMAND_KEYS = (
    "initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
    "head_start_ray_commands", "worker_start_ray_commands",
)  # fmt: skip


@dataclass(frozen=True)
class Problem:
    where: str  # the key path, e.g. available_node_types.v100x4.resources.GPU
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class ClusterConfigError(ValueError):
    """A cluster config that cannot be used; ``problems`` lists every broken rule."""

    def __init__(self, path: Path, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n".join(f"{path}: {problem}" for problem in problems)
        super().__init__(f"{len(problems)} problem(s) in cluster config {path}\n{lines}")


def check_cluster_file(path: Path, ray_version: str | None = None) -> dict[str, Any]:
    """The config of ``path`` as Ray prepares it; raises `ClusterConfigError`."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as error:  # the OS's words, without its "[Errno N]"
        said = "a folder, not a file" if Path(path).is_dir() else error.strerror or str(error)
        raise ClusterConfigError(path, [Problem("(file)", said)]) from None
    except UnicodeDecodeError as error:
        said = f"not UTF-8 text (byte {error.start}): save it as UTF-8"
        raise ClusterConfigError(path, [Problem("(file)", said)]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "(file)"
        said = f"not valid YAML: {getattr(error, 'problem', None) or error}"
        raise ClusterConfigError(path, [Problem(where, said)]) from None
    if not isinstance(config, dict):
        raise ClusterConfigError(path, [Problem("(file)", "not a YAML mapping")])
    shapes = _top_level_problems(config)
    if shapes:  # Ray's preparation would fail on them with a Python error of its own
        raise ClusterConfigError(path, shapes)
    prepared, problems = ray_prepared(config)
    problems += overlapkit_problems(prepared, ray_version or _installed_ray())
    if problems:
        raise ClusterConfigError(path, problems)
    return prepared


def _top_level_problems(config: dict[str, Any]) -> list[Problem]:
    """The top-level keys Ray's preparation and the rules below read, of the type they need."""
    if "provider" not in config:  # Ray's own check names only the key, as a bare KeyError
        said = "required key missing: provider (where the machines come from: gcp, aws, ...)"
        return [Problem("(top level)", said)]
    provider = config["provider"]
    if not isinstance(provider, dict) or "type" not in provider:
        said = f"must be a mapping with a type (type: gcp, region: ...), got {_got(provider)}"
        return [Problem("provider", said)]
    for key in COMMAND_KEYS:
        commands = config.get(key)
        if commands is not None and not isinstance(commands, list):
            said = f"must be a list of commands (each on a '- ' line), got {_got(commands)}"
            return [Problem(key, said)]
    nodes = config.get("available_node_types")
    if nodes is not None and not isinstance(nodes, dict):
        said = f"must be a mapping of node type names to settings (v100x4: ...), got {_got(nodes)}"
        return [Problem("available_node_types", said)]
    return []


def ray_prepared(config: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """Ray's preparation (defaults merged in) and schema validation."""
    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError:
        return config, [Problem("(ray)", "Ray is not installed: pip install 'overlapkit[ray]'")]
    import jsonschema

    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)
    provider = (config.get("provider") or {}).get("type")
    try:
        # The fake provider's defaults file is not in Ray's wheel: its config must be
        # complete (as cluster/local.yaml is) and is validated as it stands.
        prepared = copy.deepcopy(config) if provider == "fake_multinode" else prepare_config(config)
        validate_config(prepared)
    except jsonschema.ValidationError as error:
        where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
        return config, [Problem(where, f"Ray's schema: {error.message}")]
    except NotImplementedError as error:  # Ray's word for a provider type it does not know
        return config, [Problem("provider.type", f"Ray knows no such provider: {error}")]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return config, [Problem("(ray)", f"Ray rejects the config: {error}")]
    return prepared, []


def overlapkit_problems(config: dict[str, Any], ray_version: str | None) -> list[Problem]:
    problems: list[Problem] = []
    provider = (config.get("provider") or {}).get("type")
    if provider == "gcp":
        problems += _project_problems(config["provider"].get("project_id"))
        problems += _zone_problems(config["provider"])
    for name, node in (config.get("available_node_types") or {}).items():
        problems += _node_problems(f"available_node_types.{name}", node, provider)
    if provider not in ONE_MACHINE:
        problems += _setup_problems(config, ray_version)
    return problems


def _project_problems(project: Any) -> list[Problem]:
    """GCP's project ID: a launch fails without a real one (the shipped config has none)."""
    where, find = "provider.project_id", "see `gcloud config get-value project`"
    if project is None or project == "":
        return [Problem(where, f"required for GCP: set your project's ID ({find})")]
    if isinstance(project, str) and project.startswith("your-"):
        return [Problem(where, f"{project} is a placeholder: set your project's ID ({find})")]
    if not isinstance(project, str) or not re.fullmatch(PROJECT_ID, project):
        said = "not a GCP project ID (6-30 lowercase letters, digits and hyphens, from a letter)"
        return [Problem(where, f"{said}: {project!r} ({find})")]
    return []


def _zone_problems(provider: dict[str, Any]) -> list[Problem]:
    """GCP's zone lies in its region (us-central1-a in us-central1): the launcher asks
    for VMs in the zone, and fails only then, on Google's side."""
    region, zone = provider.get("region"), provider.get("availability_zone")
    if not (isinstance(region, str) and isinstance(zone, str) and region and zone):
        return []  # Ray's schema says what is missing
    if zone.rpartition("-")[0] == region:
        return []
    said = f"{zone} is not a zone of provider.region {region} (its zones are {region}-a, -b, ...)"
    return [Problem("provider.availability_zone", said)]


def _node_problems(where: str, node: Any, provider: str | None) -> list[Problem]:
    if not isinstance(node, dict):
        return [Problem(where, f"must be a mapping (resources, node_config...), got {node!r}")]
    shapes = _shape_problems(where, node)
    if shapes:
        return shapes
    problems = []
    resources = node.get("resources") or {}
    for key, value in resources.items():
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(
                Problem(f"{where}.resources.{key}", f"must be a whole number, got {value!r}")
            )
    problems += _worker_count_problems(where, node)
    node_config = node.get("node_config") or {}
    accelerators = node_config.get("guestAccelerators") or []
    gpus = sum(int(a.get("acceleratorCount", 0)) for a in accelerators)
    if accelerators:
        maintenance = _scheduling(node_config).get("onHostMaintenance")
        if maintenance != "TERMINATE":
            problems.append(
                Problem(
                    f"{where}.node_config.scheduling.onHostMaintenance",
                    f"a VM with GPUs cannot live-migrate: set TERMINATE (got {maintenance})",
                )
            )
        machine = str(node_config.get("machineType", ""))
        kinds = {str(a.get("acceleratorType", "")) for a in accelerators}
        if any("v100" in kind for kind in kinds) and not machine.startswith("n1-"):
            problems.append(
                Problem(
                    f"{where}.node_config.machineType",
                    f"V100s attach only to N1 machines (n1-*), not {machine or 'none'}",
                )
            )
    # GCP attaches GPUs as guestAccelerators (elsewhere, e.g. on a fake node, they are labels).
    gpu = resources.get("GPU")
    counted = gpu is None or (isinstance(gpu, int) and not isinstance(gpu, bool))
    if provider == "gcp" and counted and gpu != gpus:  # a GPU not a number: said above
        problems.append(
            Problem(
                f"{where}.resources.GPU",
                f"is {gpu} but {gpus} GPU(s) are attached "
                "(guestAccelerators): Ray places GPU work by this number",
            )
        )
    return problems


def _worker_count_problems(where: str, node: dict[str, Any]) -> list[Problem]:
    """min_workers and max_workers, where whole numbers (Ray's schema says where not)."""
    counts = {
        key: value
        for key in ("min_workers", "max_workers")
        if isinstance(value := node.get(key), int) and not isinstance(value, bool)
    }
    problems = [
        Problem(f"{where}.{key}", f"must be 0 or more, got {value}")
        for key, value in counts.items()
        if value < 0
    ]
    if not problems and counts.get("min_workers", 0) > counts.get("max_workers", float("inf")):
        said = f"{counts['min_workers']} is more than max_workers ({counts['max_workers']})"
        problems.append(Problem(f"{where}.min_workers", said))
    return problems


def _shape_problems(where: str, node: dict[str, Any]) -> list[Problem]:
    """The parts of a node type the rules below read, each of the type they need."""
    resources = node.get("resources") or {}
    if not isinstance(resources, dict):
        return [
            Problem(f"{where}.resources", f"must be a mapping (CPU: 8, GPU: 4), got {resources!r}")
        ]
    node_config = node.get("node_config") or {}
    if not isinstance(node_config, dict):
        return [Problem(f"{where}.node_config", f"must be a mapping, got {node_config!r}")]
    accelerators = node_config.get("guestAccelerators") or []
    key = f"{where}.node_config.guestAccelerators"
    if not isinstance(accelerators, list) or not all(isinstance(a, dict) for a in accelerators):
        example = "[{acceleratorType: nvidia-tesla-v100, acceleratorCount: 4}]"
        return [Problem(key, f"must be a list like {example}, got {accelerators!r}")]
    for k, accelerator in enumerate(accelerators):
        for required in ("acceleratorType", "acceleratorCount"):
            if accelerator.get(required) in (None, ""):
                said = "required (e.g. acceleratorType: nvidia-tesla-v100, acceleratorCount: 4)"
                return [Problem(f"{key}.{k}.{required}", said)]
        count = accelerator["acceleratorCount"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            said = f"must be a positive whole number (the GPUs attached), got {count!r}"
            return [Problem(f"{key}.{k}.acceleratorCount", said)]
    scheduling = node_config.get("scheduling") or {}
    items = scheduling if isinstance(scheduling, list) else [scheduling]
    if not all(isinstance(item, dict) for item in items):
        example = "[{onHostMaintenance: TERMINATE}]"
        return [
            Problem(
                f"{where}.node_config.scheduling",
                f"must be a mapping or a list like {example}, got {scheduling!r}",
            )
        ]
    return []


def _scheduling(node_config: dict[str, Any]) -> dict[str, Any]:
    """GCP's scheduling, written as a mapping or (as Ray's examples do) a list of them."""
    scheduling = node_config.get("scheduling") or {}
    if isinstance(scheduling, list):
        merged: dict[str, Any] = {}
        for item in scheduling:
            merged.update(item or {})
        return merged
    return scheduling


def _commands(config: dict[str, Any]) -> str:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands")
    return "\n".join(str(c) for key in keys for c in (config.get(key) or []))


def _setup_problems(config: dict[str, Any], ray_version: str | None) -> list[Problem]:
    problems = []
    commands = _commands(config)
    pinned = re.search(r"\bray(?:\[[\w,\s-]*\])?==([\w.]+)", commands)
    if pinned is None:
        problems.append(
            Problem("setup_commands", "Ray is not pinned (pip install 'ray[default]==X.Y.Z')")
        )
    elif ray_version and pinned.group(1) != ray_version:
        problems.append(
            Problem(
                "setup_commands",
                f"the nodes install Ray {pinned.group(1)} but this machine has {ray_version}: "
                "a Ray client must run the cluster's version",
            )
        )
    mounted = {str(target) for target in (config.get("file_mounts") or {})}
    from_checkout = any(
        target in line and "pip install" in line
        for target in mounted
        for line in commands.splitlines()
    )
    if not (re.search(r"\boverlapkit(?:\[[\w,\s-]*\])?==[\w.]+", commands) or from_checkout):
        problems.append(
            Problem(
                "setup_commands",
                "overlapkit is not pinned: install overlapkit==X.Y.Z, or from a checkout "
                "synced by file_mounts (every node then runs your version)",
            )
        )
    problems += _storage_problems(commands)
    return problems


def _storage_problems(commands: str) -> list[Problem]:
    found = re.search(rf"{STORAGE_VARIABLE}=(\S+)", commands)
    if found is None:
        return [
            Problem(
                "setup_commands",
                f"no study storage: export {STORAGE_VARIABLE}=postgresql+psycopg2://USER@HOST/DB "
                "(a server every node reaches, e.g. on the head) in the setup commands",
            )
        ]
    url = re.sub(r"['\"]", "", found.group(1))  # a shell word, quotes and all
    if not url.startswith(("postgresql", "mysql")):
        return [
            Problem(
                "setup_commands",
                f"{STORAGE_VARIABLE}={url}: a file on one node's disk; the workers need a "
                "database server they can reach (postgresql+psycopg2://...)",
            )
        ]
    host = re.sub(r"^[^@]*@", "", url.split("://", 1)[-1]).split("/")[0].split(":")[0]
    if host in ("", "localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return [
            Problem(
                "setup_commands",
                f"{STORAGE_VARIABLE} points at {host or 'this node'}: each worker would look on "
                "its own machine; use the head's address ($RAY_HEAD_IP) or a server's name",
            )
        ]
    return []


def _got(value: Any) -> str:
    """``value`` as a message shows it: a list, mapping or long string by its kind."""
    if value is None:
        return "null"
    if isinstance(value, str) and len(value) > 40:
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "a mapping" if isinstance(value, dict) else repr(value)


def _installed_ray() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    return ray.__version__
