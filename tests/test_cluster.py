"""``overlapkit cluster check``: the shipped configs pass; each rule rejects a config
that breaks it, naming the node type and key. Offline: no cloud, no credentials."""

import json
import os
from pathlib import Path

import pytest
import yaml

from overlapkit.cli import main
from overlapkit.launch.cluster import ClusterConfigError, check_cluster_file

pytest.importorskip("ray")

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"


def gcp() -> dict:
    """The shipped GCP config, its project ID set (it ships a placeholder)."""
    config = yaml.safe_load((CLUSTER / "gcp-v100.yaml").read_text())
    config["provider"]["project_id"] = "overlapkit-study-1"
    return config


def problems(config: dict, tmp_path: Path, ray_version: str = "2.60.0") -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ClusterConfigError) as error:
        check_cluster_file(path, ray_version)
    return str(error.value)


def test_the_shipped_configs_pass(tmp_path, capsys):
    """local.yaml as it is; gcp-v100.yaml once its project ID is set, and as shipped
    with that one problem: check must not say ok to a config `ray up` would refuse."""
    assert main(["cluster", "check", str(CLUSTER / "local.yaml")]) == 0
    assert "ok" in capsys.readouterr().out
    path = tmp_path / "gcp-v100.yaml"
    path.write_text(yaml.safe_dump(gcp()))
    assert main(["cluster", "check", str(path)]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["cluster", "check", str(CLUSTER / "gcp-v100.yaml")]) == 2
    err = capsys.readouterr().err
    assert "1 problem(s)" in err
    assert "provider.project_id: your-project-id is a placeholder: set your project's ID" in err


def test_the_gcp_config_has_the_node_types_a_study_needs(tmp_path):
    path = tmp_path / "gcp-v100.yaml"
    path.write_text(yaml.safe_dump(gcp()))
    nodes = check_cluster_file(path, "2.60.0")["available_node_types"]
    gpus = {name: node["resources"]["GPU"] for name, node in nodes.items()}
    assert gpus == {"head": 0, "v100x1": 1, "v100x4": 4, "v100x8": 8}
    local = yaml.safe_load((CLUSTER / "local.yaml").read_text())["available_node_types"]
    assert {n: v["resources"].get("GPU", 0) for n, v in local.items()} == {
        "ray.head.default": 0,
        "v100x1": 1,
        "v100x4": 4,
        "v100x8": 8,
    }


def test_a_zone_outside_the_region_is_refused(tmp_path):
    config = gcp()
    config["provider"]["availability_zone"] = "europe-west4-a"  # region us-central1
    assert (
        "provider.availability_zone: europe-west4-a is not a zone of provider.region "
        "us-central1" in problems(config, tmp_path)
    )
    config["provider"]["availability_zone"] = "us-central1-f"
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(config))
    check_cluster_file(path, "2.60.0")


def test_rays_schema_runs_first(tmp_path):
    config = gcp()
    config["max_wrokers"] = 3
    assert "Ray's schema: Additional properties are not allowed ('max_wrokers'" in problems(
        config, tmp_path
    )


def test_fractional_resources_are_refused_with_node_type_and_key(tmp_path):
    config = gcp()
    config["available_node_types"]["v100x4"]["resources"]["CPU"] = 31.5
    assert "available_node_types.v100x4.resources.CPU" in problems(config, tmp_path)


def test_a_gpu_node_that_would_live_migrate_is_refused(tmp_path):
    config = gcp()
    config["available_node_types"]["v100x8"]["node_config"]["scheduling"] = [
        {"onHostMaintenance": "MIGRATE"}
    ]
    message = problems(config, tmp_path)
    assert "available_node_types.v100x8.node_config.scheduling.onHostMaintenance" in message
    assert "cannot live-migrate: set TERMINATE (got MIGRATE)" in message


def test_v100s_only_on_n1_machines(tmp_path):
    config = gcp()
    config["available_node_types"]["v100x1"]["node_config"]["machineType"] = "n2-standard-8"
    message = problems(config, tmp_path)
    assert "available_node_types.v100x1.node_config.machineType" in message
    assert "V100s attach only to N1 machines (n1-*), not n2-standard-8" in message


def test_the_gpu_resource_must_match_the_accelerators(tmp_path):
    config = gcp()
    config["available_node_types"]["v100x4"]["resources"]["GPU"] = 8
    message = problems(config, tmp_path)
    assert "available_node_types.v100x4.resources.GPU: is 8 but 4 GPU(s) are attached" in message


def test_ray_must_be_pinned_to_the_drivers_version(tmp_path):
    config = gcp()
    config["setup_commands"][0] = config["setup_commands"][0].replace("==2.60.0", "")
    assert "setup_commands: Ray is not pinned" in problems(config, tmp_path)
    assert "install Ray 2.60.0 but this machine has 2.59.0" in problems(gcp(), tmp_path, "2.59.0")


def test_overlapkit_must_be_pinned(tmp_path):
    config = gcp()
    config["file_mounts"] = {}  # the install no longer comes from a synced checkout
    assert "overlapkit is not pinned" in problems(config, tmp_path)
    config["setup_commands"].append("pip install overlapkit==0.1.0")
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump(config))
    check_cluster_file(path, "2.60.0")


@pytest.mark.parametrize(
    ("storage", "expected"),
    [
        (None, "no study storage"),
        ("sqlite:///study.db", "a file on one node's disk"),
        ("postgresql+psycopg2://optuna@127.0.0.1:5432/optuna", "points at 127.0.0.1"),
        ("postgresql+psycopg2://optuna@localhost/optuna", "points at localhost"),
    ],
)
def test_the_study_storage_must_be_reachable_from_the_workers(storage, expected, tmp_path):
    config = gcp()
    commands = [c for c in config["setup_commands"] if "OVERLAPKIT_STORAGE" not in c]
    if storage is not None:
        commands.append(f"echo 'export OVERLAPKIT_STORAGE={storage}' >> ~/.bashrc")
    config["setup_commands"] = commands
    assert expected in problems(config, tmp_path)


def test_the_cli_reports_every_problem_and_exits_2(tmp_path, capsys):
    config = gcp()
    config["available_node_types"]["v100x1"]["node_config"]["machineType"] = "a2-highgpu-1g"
    config["available_node_types"]["v100x4"]["resources"]["GPU"] = 2
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["cluster", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s)" in err and "v100x1" in err and "v100x4" in err
    assert "Traceback" not in err


SPREAD_OVER_FAKE_V100_NODES = """
import json, ray, sys
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], logging_level="ERROR")
pg = placement_group([{"GPU": 2, "CPU": 1}, {"GPU": 2, "CPU": 1}], strategy="SPREAD")
assert pg.wait(90), "no nodes came up for the placement group"
print("NODE_GPUS", json.dumps(sorted(int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])))
"""


def processes() -> dict[int, tuple[int, int, str]]:
    """This machine's processes: pid -> (parent pid, process group, state), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, parent, group = stat.rsplit(")", 1)[1].split()[:3]  # after "pid (name)"
        found[int(entry.name)] = (int(parent), int(group), state)
    return found


def stop_process_group(group: int) -> list[int]:
    """SIGKILL process group ``group`` and its members' children in groups of their own
    (Ray's workers), and wait until they are gone; returns those still running. Only
    the cluster a test started: `ray stop` stops every Ray process on the machine."""
    import signal
    import time

    table = processes()
    doomed = {pid for pid, (_, pgid, _) in table.items() if pgid == group}
    while more := {pid for pid, (ppid, _, _) in table.items() if ppid in doomed} - doomed:
        doomed |= more
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while True:
        table = processes()
        left = [pid for pid in doomed if pid in table and table[pid][2] != "Z"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.slow
def test_the_local_config_drives_rays_autoscaler_on_this_machine(tmp_path):
    """Two ranks of 2 GPUs each: nothing holds them until the fake autoscaler starts
    worker nodes of local.yaml's types (the head has no GPU). Then the test stops its
    cluster, all of it, and nothing else: a process `ray stop` would take for Ray's (a
    user's own cluster beside the tests) still runs."""
    import shutil
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "RAY_FAKE_CLUSTER": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # Ray's autoscaler looks every 5 s by default
    }
    ray = str(Path(sys.executable).with_name("ray"))  # the venv's, activated or not
    temp = Path("/tmp") / f"okray{port}"  # Unix socket paths must stay short
    # On a port other than 6379 the fake provider must be told where the head is.
    from ray.util import get_node_ip_address

    address = f"{get_node_ip_address()}:{port}"
    config = yaml.safe_load((CLUSTER / "local.yaml").read_text())
    config["provider"]["gcs_address"] = address
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(config))
    start = [
        ray, "start", "--head", f"--port={port}", f"--temp-dir={temp}",
        f"--autoscaling-config={tmp_path / 'local.yaml'}",
        "--object-store-memory=100000000", "--include-dashboard=false",
    ]  # fmt: skip
    # `ray stop` matches Ray's processes by their command lines: this one is among them.
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(900)", "ray.util.client.server"]
    )
    # The cluster's processes (the nodes the autoscaler adds too) stay in the process
    # group of `ray start`, a group of its own.
    head = subprocess.Popen(
        start,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            _, said = head.communicate(timeout=120)
            assert head.returncode == 0, said[-2000:]
            driver = subprocess.run(
                [sys.executable, "-c", SPREAD_OVER_FAKE_V100_NODES, address],
                env=env,
                capture_output=True,
                text=True,
                timeout=150,
            )
            assert driver.returncode == 0, driver.stderr[-2000:]
            # Ray's autoscaler also writes to the driver's stdout ("Resized to ..."), in any order.
            (line,) = [x for x in driver.stdout.splitlines() if x.startswith("NODE_GPUS ")]
            gpus = json.loads(line.removeprefix("NODE_GPUS "))
            assert gpus[0] == 0 and set(gpus[1:]) <= {1, 4, 8} and sum(gpus) >= 4
        finally:
            left = stop_process_group(head.pid)
            shutil.rmtree(temp, ignore_errors=True)
        assert left == [], f"the test's Ray processes {left} outlived SIGKILL"
        in_group = [(p, state) for p, (_, pgid, state) in processes().items() if pgid == head.pid]
        assert [p for p, state in in_group if state != "Z"] == [], "its cluster still runs"
        assert bystander.poll() is None, "stopping the test's cluster stopped another process"
    finally:
        bystander.kill()
        bystander.wait()


def test_a_config_that_is_not_one_is_said_in_a_line(tmp_path, capsys):
    """A missing file, a folder, broken YAML and a config without its required keys:
    one line each (they were a bare "'provider'", a parser dump, "[Errno 2] ...")."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("cluster_name: x\nprovider: {type: gcp\n")
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text("max_workers: 2\n")
    for path, said in (
        (tmp_path / "nosuch.yaml", "No such file or directory"),
        (tmp_path, "a folder, not a file"),
        (broken, "not valid YAML"),
        (nameless, "required key missing: provider"),  # cluster_name: Ray's default
    ):
        assert main(["cluster", "check", str(path)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Errno" not in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) <= 3, err


def test_typos_in_node_types_are_problems_not_internal_errors(tmp_path, capsys):
    """Each of these ended in an internal error (AttributeError, ValueError,
    NotImplementedError) from a config a typo away from the shipped one."""

    def edited(change):
        config = gcp()
        change(config)
        path = tmp_path / "typo.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    nodes = lambda c: c["available_node_types"]  # noqa: E731
    accelerator = lambda c: nodes(c)["v100x4"]["node_config"]["guestAccelerators"][0]  # noqa: E731
    for change, said in (
        (lambda c: c["provider"].update(type="gpc"), "provider.type: Ray knows no such provider"),
        (lambda c: nodes(c)["v100x4"].update(resources=4), "v100x4.resources: must be a mapping"),
        (
            lambda c: nodes(c)["v100x4"]["node_config"].update(
                guestAccelerators="nvidia-tesla-v100"
            ),
            "v100x4.node_config.guestAccelerators: must be a list",
        ),
        (lambda c: nodes(c)["v100x4"].update(node_config="n1-standard-32"), "v100x4.node_config"),
        (
            lambda c: accelerator(c).update(acceleratorCount="four"),
            "acceleratorCount: must be a positive whole",
        ),
        (lambda c: nodes(c).update(v100x1=None), "v100x1"),
        (
            lambda c: c.update(
                available_node_types=[{"name": n, **v} for n, v in nodes(c).items()]
            ),
            "available_node_types: must be a mapping of node type names",
        ),
        (
            lambda c: nodes(c)["v100x4"]["node_config"].update(scheduling="TERMINATE"),
            "v100x4.node_config.scheduling: must be a mapping or a list",
        ),
        (
            lambda c: nodes(c)["v100x4"]["node_config"].update(scheduling=["TERMINATE"]),
            "v100x4.node_config.scheduling: must be a mapping or a list",
        ),
    ):
        assert main(["cluster", "check", str(edited(change))]) == 2
        err = capsys.readouterr().err
        assert said in err and "internal error" not in err and "Traceback" not in err, err


def test_a_value_of_the_wrong_kind_is_said_as_such(tmp_path):
    """Each was said wrongly: "is 4 but 4 GPU(s) are attached", Ray's "can only
    concatenate str" with a false "Ray is not pinned", "'NoneType' object has no
    attribute 'get'", and a count of -4 only as a mismatch with resources.GPU."""
    nodes = lambda c: c["available_node_types"]  # noqa: E731
    accelerator = lambda c: nodes(c)["v100x4"]["node_config"]["guestAccelerators"][0]  # noqa: E731
    for change, said, not_said in (
        (
            lambda c: nodes(c)["v100x4"]["resources"].update(GPU="4"),
            "v100x4.resources.GPU: must be a whole number, got '4'",
            "GPU(s) are attached",
        ),
        (
            lambda c: c.update(setup_commands=" && ".join(c["setup_commands"])),
            "setup_commands: must be a list of commands",
            "not pinned",
        ),
        (lambda c: c.update(provider=None), "provider: must be a mapping with a type", "NoneType"),
        (
            lambda c: accelerator(c).update(acceleratorCount=-4),
            "v100x4.node_config.guestAccelerators.0.acceleratorCount: must be a positive whole",
            "GPU(s) are attached",
        ),
    ):
        config = gcp()
        change(config)
        message = problems(config, tmp_path)
        assert said in message and not_said not in message, message
        assert "concatenate" not in message and "Ray rejects" not in message, message


def test_check_refuses_what_a_launch_would(tmp_path):
    """Each of these passed the check ("ok"), and `ray up` or GCP would refuse it."""
    nodes = lambda c: c["available_node_types"]  # noqa: E731
    accelerator = lambda c: nodes(c)["v100x4"]["node_config"]["guestAccelerators"][0]  # noqa: E731
    for change, said in (
        (lambda c: c["provider"].pop("project_id"), "provider.project_id: required for GCP"),
        (
            lambda c: c["provider"].update(project_id="My Project"),
            "provider.project_id: not a GCP project ID",
        ),
        (
            lambda c: accelerator(c).pop("acceleratorType"),
            "v100x4.node_config.guestAccelerators.0.acceleratorType: required",
        ),
        (
            lambda c: nodes(c)["v100x4"].update(min_workers=5),
            "v100x4.min_workers: 5 is more than max_workers (4)",
        ),
        (
            lambda c: nodes(c)["v100x4"].update(max_workers=-1),
            "v100x4.max_workers: must be 0 or more, got -1",
        ),
        (lambda c: c.update(max_workers=-1), "max_workers: Ray's schema: -1 is less than"),
    ):
        config = gcp()
        change(config)
        message = problems(config, tmp_path)
        assert said in message and "1 problem(s)" in message, message
