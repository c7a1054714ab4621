"""The `cluster:` section and the Ray launcher's decisions that need no cluster.

The launcher itself runs on a real two-node Ray cluster in
`tests/integration/test_ray_cluster.py` (`make test-ray`).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from asyncgrpo.base.config import ConfigError, VLLMEngineConfig, build_config, parse_engine_config


def test_the_default_is_local_and_the_section_takes_its_keys():
    assert build_config({}).cluster.launcher == "local"
    cfg = build_config(
        {},
        [
            "cluster.launcher=ray",
            "cluster.address=auto",
            "cluster.engine_resources={engine: 1}",
            "cluster.trainer_resources={GPU: 1, CPU: 4}",
        ],
    )
    assert cfg.cluster.address == "auto"
    assert cfg.cluster.engine_resources == {"engine": 1.0}
    assert cfg.cluster.trainer_resources == {"GPU": 1.0, "CPU": 4.0}


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"type": "external"}, "attaches to a running server"),
        ({"type": "vllm"}, "allow_unauthenticated_vllm: true to accept that"),
    ],
)
def test_ray_refuses_engines_it_cannot_place_safely(engine, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"engine": engine, "cluster": {"launcher": "ray"}})
    opted_in = {**engine, "allow_unauthenticated_vllm": True}
    if engine["type"] == "vllm":  # said explicitly, for a private cluster network
        assert build_config({"engine": opted_in, "cluster": {"launcher": "ray"}})


def test_ray_client_addresses_are_refused_with_what_to_do_instead():
    with pytest.raises(ConfigError, match="run `asyncgrpo train` on a node of the cluster"):
        build_config({"cluster": {"launcher": "ray", "address": "ray://head:10001"}})


@pytest.mark.parametrize("bundle", [{}, {"GPU": 0}, {"engine": -1}])
def test_an_empty_or_non_positive_bundle_is_refused(bundle):
    with pytest.raises(ConfigError, match="cluster.engine_resources"):
        build_config({"cluster": {"engine_resources": bundle}})


def test_without_ray_installed_the_error_says_how_to_install_it(monkeypatch):
    from asyncgrpo.run.cluster import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'asyncgrpo\[ray\]'"):
        require_ray()


def test_the_shortfall_names_each_resource_asked_beyond_the_cluster():
    from asyncgrpo.run.cluster.placement import _shortfall

    bundles = [{"engine": 1.0}, {"engine": 1.0}, {"CPU": 1.0, "trainer": 1.0}]
    have = {"CPU": 2.0, "engine": 1.0}
    assert _shortfall(bundles, have) == "engine: 2 asked, 1 there, trainer: 1 asked, 0 there"
    assert _shortfall(bundles, {"CPU": 1.0, "engine": 2.0, "trainer": 1.0}) == ""


@pytest.mark.parametrize(
    ("engine_type", "configured", "same_node", "expected"),
    [
        ("embedded", "shm", True, "shm"),  # on the driver's node shared memory is fastest
        ("embedded", "shm", False, "http"),  # and never crosses nodes
        ("embedded", "http", True, "http"),
        ("embedded", "disk", False, "disk"),  # a directory both nodes mount is what disk is for
        ("vllm", "shm", True, "shm"),
        ("vllm", "nccl", False, "nccl"),
        ("vllm", "disk", False, "disk"),
    ],
)
def test_the_weight_transport_follows_the_placement(engine_type, configured, same_node, expected):
    from asyncgrpo.run.cluster.engines import transport_for

    exposed = {"allow_unauthenticated_vllm": True} if engine_type == "vllm" else {}
    cfg = parse_engine_config(
        {"model": "m", "type": engine_type, "weight_transport": configured, **exposed}
    )
    assert transport_for(cfg, same_node) == expected


def test_vllm_on_another_node_without_a_transport_that_reaches_it_is_refused():
    from asyncgrpo.run.cluster.engines import transport_for

    cfg = VLLMEngineConfig(model="m", weight_transport="shm")
    with pytest.raises(ConfigError, match="nccl .GPUs. or disk"):
        transport_for(cfg, same_node=False, replica=1)


class FakeActor:
    """A started `RankActor`: records the `run` call rank 0's spawner makes."""

    def __init__(self):
        self.run_args: list[tuple] = []
        self.where = SimpleNamespace(remote=lambda: "where-ref")
        self.run = SimpleNamespace(remote=lambda *args: self.run_args.append(args) or "run-ref")


class FakeCluster:
    """The parts of `RayCluster` that `rank_spawner` uses, without Ray."""

    engines = 1
    driver_ip = "10.0.0.7"

    def __init__(self):
        self.started: list[tuple] = []
        self.ray = SimpleNamespace(remote=lambda cls: cls, get=lambda ref: {"node": "n1"})

    def start(self, actor_class, bundle):
        actor = FakeActor()
        self.started.append((actor_class, bundle, actor))
        return actor

    def note(self, *args):
        pass


def test_wiring_hands_the_trainer_the_clusters_rank_spawner_and_the_drivers_address():
    from asyncgrpo.base.config import RunConfig
    from asyncgrpo.run import roles
    from asyncgrpo.run.cluster.rank_actors import RankActor, RankHandle

    cfg = build_config({}, ["trainer.num_processes=3", "cluster.launcher=ray"])
    assert roles.trainer_ranks(cfg, None) == (None, "127.0.0.1")  # child processes here
    cluster = FakeCluster()
    spawn, host = roles.trainer_ranks(cfg, cluster)
    assert host == "10.0.0.7"
    world = SimpleNamespace(size=3, procs=[])
    spawn(world, host, 29500)
    assert [(cls, bundle) for cls, bundle, _ in cluster.started] == [(RankActor, 1), (RankActor, 2)]
    calls = [actor.run_args for *_, actor in cluster.started]
    assert [c[0][1:] for c in calls] == [(1, 3, "10.0.0.7", 29500), (2, 3, "10.0.0.7", 29500)]
    assert RunConfig.model_validate_json(calls[0][0][0]) == cfg
    assert len(world.procs) == 2 and all(isinstance(p, RankHandle) for p in world.procs)
