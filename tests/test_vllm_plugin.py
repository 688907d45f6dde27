"""The vLLM plugin without an engine: its settings, checks, CPU expert-parallel fix and metrics.

The tests that build vLLM configuration objects need the ``vllm`` extra (``pip install -e
'.[vllm]'``; CI installs it) and skip with that reason without it. Real engines are in
``test_vllm_engine.py``.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

import eplb_graph
from eplb_graph import ConfigError
from eplb_graph.integrations.vllm.compat import PatchTarget
from eplb_graph.integrations.vllm.expert_parallel import to_local
from eplb_graph.integrations.vllm.metrics import (
    MetricsFileCollector,
    RankMetricsFile,
    placement_digest,
)
from eplb_graph.integrations.vllm.options import PREFIX, PluginOptions

# -- options (no vLLM needed) ---------------------------------------------------------------------


def test_an_empty_section_takes_every_default():
    options = PluginOptions.from_section(None)
    assert (options.policy, options.layers_per_step, options.commit_margin_steps) == (None, 1, 8)


def test_unknown_keys_are_named_with_a_suggestion():
    with pytest.raises(
        ConfigError, match=r"eplb_graph\.polcy: unknown key \(did you mean 'policy'"
    ):
        PluginOptions.from_section({"polcy": "default"})


@pytest.mark.parametrize(
    ("section", "field", "reason"),
    [
        ({"policy": "fastest"}, "policy", "unknown policy 'fastest'"),
        ({"layers_per_step": 0}, "layers_per_step", "must be >= 1"),
        ({"layers_per_step": True}, "layers_per_step", "expected an integer"),
        ({"commit_margin_steps": "8"}, "commit_margin_steps", "expected an integer"),
        ({"min_gain_percent": 100}, "min_gain_percent", "must be <= 99"),
        ({"min_gain_percent": 0.05}, "min_gain_percent", "expected an integer"),
        ({"load_collection_phase": "chunked"}, "load_collection_phase", "must be one of"),
        ({"policy_options": {"budget": 0.1}}, "policy_options", "without a policy"),
        ({"policy": "churn_aware", "policy_options": [1]}, "policy_options", "JSON object"),
        ({"expert_map_path": "/nonexistent/map.json"}, "expert_map_path", "does not exist"),
        ({"record_map_path": "/nonexistent/dir/map.json"}, "record_map_path", "does not exist"),
        ({"metrics_path": "/nonexistent/dir/metrics"}, "metrics_path", "does not exist"),
    ],
)
def test_each_bad_value_names_its_field(section, field, reason):
    with pytest.raises(ConfigError, match=reason) as info:
        PluginOptions.from_section(section)
    assert info.value.field == f"{PREFIX}.{field}"


def test_a_starting_map_and_record_mode_exclude_each_other(tmp_path):
    existing = tmp_path / "start.json"
    existing.write_text("{}")
    with pytest.raises(ConfigError, match="record mode never moves weights") as info:
        PluginOptions.from_section(
            {"expert_map_path": str(existing), "record_map_path": str(tmp_path / "r.json")}
        )
    assert info.value.field == f"{PREFIX}.record_map_path"


def test_a_metrics_path_that_is_a_file_is_refused(tmp_path):
    existing = tmp_path / "file"
    existing.write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        PluginOptions.from_section({"metrics_path": str(existing)})


@pytest.mark.parametrize("where", ["/proc/eplb-graph-metrics", "/proc/self", "/sys/fs/eplbm"])
def test_a_metrics_path_that_cannot_be_written_fails_at_start(monkeypatch, where):
    """``os.access`` says yes to root everywhere (emulated here for other users): the check
    must really write, as the workers will, or they die on their first write minutes later."""
    from eplb_graph.integrations.settings import paths

    monkeypatch.setattr(paths.os, "access", lambda *args, **kwargs: True)
    with pytest.raises(ConfigError, match=r"cannot (write in|create) directory") as info:
        PluginOptions.from_section({"metrics_path": where})
    assert info.value.field == f"{PREFIX}.metrics_path"


def test_a_writable_metrics_path_is_created_and_left_clean(tmp_path):
    target = tmp_path / "metrics"
    PluginOptions.from_section({"metrics_path": str(target)})
    assert target.is_dir() and list(target.iterdir()) == []  # the probe file is gone
    PluginOptions.from_section({"record_map_path": str(tmp_path / "plans.json")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics"]


def test_a_symlink_loop_as_the_map_is_called_a_loop(tmp_path):
    loop = tmp_path / "map.json"
    loop.symlink_to(tmp_path / "other.json")
    (tmp_path / "other.json").symlink_to(loop)
    with pytest.raises(ConfigError, match="a symlink loop") as info:
        PluginOptions.from_section({"expert_map_path": str(loop)})
    assert "does not exist" not in str(info.value)


# -- the CPU expert-parallel fix ------------------------------------------------------------------


def test_physical_slots_become_local_rows_and_other_ranks_slots_weigh_nothing():
    expert_map = torch.tensor([-1, -1, -1, 0, 1, 2], dtype=torch.int32)  # rank 1 of 2, 3 slots
    ids = torch.tensor([[0, 3], [4, 5], [2, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    local, kept = to_local(ids, weights, expert_map)
    assert local.dtype == ids.dtype
    assert local.tolist() == [[0, 0], [1, 2], [0, 0]]
    assert torch.equal(kept, torch.tensor([[0.0, 0.4], [0.7, 0.3], [0.0, 0.0]]))


def test_the_two_ranks_partial_outputs_sum_to_the_unsplit_output():
    """What the combine relies on: each choice is weighted on exactly one rank."""
    experts = torch.randn(6, 4)  # one "output vector" per physical slot
    ids = torch.randint(0, 6, (5, 2))
    weights = torch.rand(5, 2)
    full = (weights.unsqueeze(-1) * experts[ids]).sum(dim=1)
    partial = torch.zeros(5, 4)
    for rank in range(2):
        expert_map = torch.full((6,), -1)
        expert_map[3 * rank : 3 * rank + 3] = torch.arange(3)
        local, kept = to_local(ids, weights, expert_map)
        rows = experts[3 * rank : 3 * rank + 3]
        partial += (kept.unsqueeze(-1) * rows[local]).sum(dim=1)
    assert torch.allclose(partial, full)


# -- patch targets ---------------------------------------------------------------------------------


def test_a_changed_signature_is_reported_by_name(monkeypatch):
    module = types.ModuleType("fake_vllm_module")

    def hook(topk_ids, load):  # one parameter fewer than expected
        return topk_ids

    module.hook = hook
    monkeypatch.setitem(__import__("sys").modules, "fake_vllm_module", module)
    target = PatchTarget("fake_vllm_module", "hook", ("topk_ids", "load", "offset"))
    assert "has parameters ['topk_ids', 'load'], expected ['topk_ids', 'load', 'offset']" in (
        target.problem() or ""
    )
    assert (
        PatchTarget("fake_vllm_module", "missing", ())
        .problem()
        .startswith("fake_vllm_module.missing is missing")
    )
    assert PatchTarget("fake_vllm_module", "hook", ("topk_ids", "load")).problem() is None


def test_llama4_fused_experts_expand_to_physical_slots_of_the_default_layout():
    """Slot p holds expert p mod N at load time: row p of the expanded tensor is expert p mod N,
    so vLLM's loader, indexing with a rank's physical slot ids, loads the expert each slot holds
    (without it, slot 8 of 8 experts + 2 redundant raised IndexError)."""
    from eplb_graph.integrations.vllm.llama4_loading import physical_rows

    weight = torch.randn(8, 3, 5)
    expanded = physical_rows(weight, 2)
    assert expanded.shape == (10, 3, 5)
    for slot in range(10):
        assert torch.equal(expanded[slot], weight[slot % 8])
    # Rank 1 of 2 holds slots 5..9: experts 5, 6, 7, 0, 1.
    expert_map = torch.full((10,), -1)
    expert_map[5:] = torch.arange(5)
    local = (expert_map != -1).nonzero().flatten()
    assert torch.equal(expanded[local], weight[[5, 6, 7, 0, 1]])
    assert torch.equal(physical_rows(weight, 0), weight)


# -- metrics files ---------------------------------------------------------------------------------


def test_the_digest_changes_exactly_when_the_placement_changes():
    a = torch.tensor([[0, 1, 2, 3]])
    assert placement_digest(a) == placement_digest(a.clone())
    assert placement_digest(a) != placement_digest(torch.tensor([[0, 1, 3, 2]]))


def test_a_rank_file_is_rewritten_only_when_progress_is_made(tmp_path):
    writer = RankMetricsFile(str(tmp_path / "m"), 1)
    built = []

    def document(committed):
        def build():
            built.append(committed)
            return {"rank": 1, "layers_committed": committed}

        return build

    assert writer.update((0, 0), document(0))
    assert not writer.update((0, 0), document(0))  # no counter moved: not even built
    assert writer.update((0, 1), document(1))
    assert writer.update((0, 1), document(1), force=True)
    assert built == [0, 1, 1]
    assert json.loads(writer.path.read_text())["layers_committed"] == 1
    assert [p.name for p in writer.path.parent.iterdir()] == ["rank1.json"]  # no temp left


def test_prometheus_collector_exports_every_rank_file(tmp_path):
    pytest.importorskip("prometheus_client", reason="prometheus_client comes with the vllm extra")
    from prometheus_client import CollectorRegistry, generate_latest

    for rank, committed in ((0, 4), (1, 4)):
        RankMetricsFile(str(tmp_path), rank).update(
            (committed,),
            lambda rank=rank, committed=committed: {
                "rank": rank,
                "steps": 10,
                "rearrangements": 2,
                "aborted": 1,
                "layers_committed": committed,
                "bytes_received": 100,
                "balancedness": 0.75,
                "placement_version": committed,
                "placement_digest": "abc",
            },
        )
    (tmp_path / "rank2.json").write_text("{not json")  # a torn file is skipped, not fatal
    registry = CollectorRegistry()
    registry.register(MetricsFileCollector(str(tmp_path)))
    text = generate_latest(registry).decode()
    assert 'eplb_graph_layers_committed_total{rank="1"} 4.0' in text
    assert 'eplb_graph_rearrangements_aborted_total{rank="0"} 1.0' in text
    assert 'eplb_graph_balancedness{rank="0"} 0.75' in text
    assert 'eplb_graph_placement_info{digest="abc",rank="1"} 1.0' in text


def test_prometheus_exports_expert_time_and_measured_balancedness(tmp_path):
    """The busiest rank is measured, not counted: mean / max of the ranks' median expert ms;
    absent (not a misleading number) until every rank has a sample."""
    pytest.importorskip("prometheus_client", reason="prometheus_client comes with the vllm extra")
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(MetricsFileCollector(str(tmp_path)))
    for rank, p50 in ((0, 3.0), (1, None)):
        RankMetricsFile(str(tmp_path), rank).update(
            (rank,), lambda rank=rank, p50=p50: {"rank": rank, "expert_ms": {"p50": p50}}
        )
    text = generate_latest(registry).decode()
    assert 'eplb_graph_expert_ms{rank="0"} 3.0' in text
    assert "\neplb_graph_balancedness_measured " not in text  # rank 1 has no sample yet
    RankMetricsFile(str(tmp_path), 1).update(
        (9,), lambda: {"rank": 1, "expert_ms": {"count": 5, "p50": 1.0, "p99": 2.0}}
    )
    text = generate_latest(registry).decode()
    assert 'eplb_graph_expert_ms{rank="1"} 1.0' in text
    assert "\neplb_graph_balancedness_measured 0.6666" in text  # (3 + 1) / 2 / 3


def test_a_second_metrics_directory_in_one_process_is_not_exported_twice(tmp_path, monkeypatch):
    """Two engines with two metrics paths in one process: the registry would refuse the second
    collector's identical series; the second directory is written, not exported, and no error."""
    pytest.importorskip("prometheus_client", reason="prometheus_client comes with the vllm extra")
    import prometheus_client

    from eplb_graph.integrations.vllm import metrics

    registry = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", registry)
    monkeypatch.setattr(metrics, "_REGISTERED", set())
    assert metrics.register_prometheus_collector(str(tmp_path / "a")) is True
    assert metrics.register_prometheus_collector(str(tmp_path / "a")) is True
    assert metrics.register_prometheus_collector(str(tmp_path / "b")) is False
    assert len(metrics._REGISTERED) == 1


# -- against vLLM's own configuration objects ------------------------------------------------------


@pytest.fixture(scope="module")
def engine_args(tmp_path_factory):
    """``EngineArgs`` for the tiny model with this plugin registered (no engine is started)."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")
    import eplb_graph.integrations.vllm as plugin
    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    plugin.register()
    model = write_tiny_qwen3_moe(tmp_path_factory.mktemp("model"))
    from vllm.engine.arg_utils import EngineArgs

    def make(**overrides):
        settings = dict(
            model=str(model),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=128,
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            enable_eplb=True,
            eplb_config={"window_size": 4, "step_interval": 8, "num_redundant_experts": 2},
        )
        settings.update(overrides)
        return EngineArgs(**settings)

    return make


@pytest.mark.vllm
def test_vllm_accepts_eplb_on_cpu_with_the_plugin(engine_args):
    from eplb_graph.integrations.settings import resolve_eplb_config
    from eplb_graph.integrations.vllm.settings import eplb_settings

    config = engine_args(
        additional_config={"eplb_graph": {"policy": "churn_aware", "layers_per_step": 2}}
    ).create_engine_config()
    assert config.parallel_config.enable_eplb
    settings = eplb_settings(config, num_layers=2)
    assert settings.policy == "churn_aware"
    assert (settings.window_size, settings.step_interval) == (4, 8)
    assert settings.layers_per_step == 2
    assert settings.num_redundant_experts == 2 and settings.use_async
    # The one settings path every host takes: vLLM's settings are resolve_eplb_config's value.
    expected = resolve_eplb_config(
        enable_eplb=True,
        eplb_config={"window_size": 4, "step_interval": 8, "num_redundant_experts": 2},
        additional_config=None,
        num_experts=config.model_config.get_num_experts(),
        ep_size=config.parallel_config.tensor_parallel_size,
        num_layers=2,
    )
    assert settings.initial_placement == expected.initial_placement
    assert settings.move_to is None and settings.record_map_path is None


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("experts", "redundant", "ranks"),
    [(6, 2, 2), (8, 0, 2), (8, 2, 4)],
    ids=["experts", "redundant", "ranks"],
)
def test_attach_refuses_a_model_that_disagrees_with_vllms_configuration(
    engine_args, experts, redundant, ranks
):
    """One source of truth: a loaded model whose experts, redundancy or EP ranks differ from
    what vLLM's configuration says is a bug to stop at attach, before anything is bound."""
    from eplb_graph.integrations.vllm import attach

    config = engine_args().create_engine_config()
    model = types.SimpleNamespace(
        num_moe_layers=2, num_logical_experts=experts, num_redundant_experts=redundant
    )
    group = types.SimpleNamespace(rank_in_group=0, world_size=ranks, ranks=list(range(ranks)))
    bound = []
    with pytest.raises(RuntimeError, match=r"are \(2, 8, 2, 2\) in vLLM's configuration but"):
        attach.start(
            types.SimpleNamespace(vllm_config=config),
            model,
            group,
            bind=lambda *args: bound.append(args),
            weight_views=lambda model: [],
            record_load=lambda rank: True,
        )
    assert bound == []


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"additional_config": {"eplb_graph": {"polcy": "x"}}}, f"{PREFIX}.polcy", "did you mean"),
        (
            {"additional_config": {"eplb_graph": {"rearrange": "sometimes"}}},
            f"{PREFIX}.rearrange",
            "when_it_pays",
        ),
        (
            {"eplb_config": {"window_size": 4, "step_interval": 8, "num_redundant_experts": 1}},
            "eplb_config.num_redundant_experts",
            "not divisible by ep_size=2",
        ),
        (
            {
                "additional_config": {
                    "eplb_graph": {"policy": "default", "policy_options": {"x": 1}}
                }
            },
            f"{PREFIX}.policy_options",
            "has no option",
        ),
        (
            {"enable_eplb": False, "eplb_config": {}, "additional_config": {"eplb_graph": {}}},
            PREFIX,
            "EPLB is off",
        ),
        (
            {"additional_config": {"dynamic_eplb": True}},
            "additional_config.dynamic_eplb",
            "legacy",
        ),
    ],
)
def test_bad_settings_fail_when_vllm_builds_its_config(engine_args, overrides, field, reason):
    with pytest.raises(ConfigError, match=reason) as info:
        engine_args(**overrides).create_engine_config()
    assert info.value.field == field


@pytest.mark.vllm
def test_the_models_shape_is_checked_where_vllm_builds_its_config(engine_args, tmp_path):
    """The tiny model has 2 MoE layers: a 3-layer map fails before any worker starts, and a
    layers_per_step beyond the model is capped there already."""
    from eplb_graph import Placement
    from eplb_graph.integrations.vllm.settings import eplb_settings
    from eplb_graph.models.tiny_qwen3_moe import NUM_EXPERTS

    path = tmp_path / "three_layers.json"
    Placement.default(3, NUM_EXPERTS, 2, 2).save_expert_map(path)
    with pytest.raises(ConfigError, match="the map has 3 MoE layers, the model 2") as info:
        engine_args(
            additional_config={"eplb_graph": {"expert_map_path": str(path)}}
        ).create_engine_config()
    assert info.value.field == f"{PREFIX}.expert_map_path"
    config = engine_args(
        additional_config={"eplb_graph": {"layers_per_step": 65536}}
    ).create_engine_config()
    assert eplb_settings(config).layers_per_step == 2


def test_moe_layer_counts_follow_each_familys_rule():
    from eplb_graph.integrations.vllm.model_shape import hidden_layer_count, moe_layer_count

    def model(**fields):
        return types.SimpleNamespace(hf_text_config=types.SimpleNamespace(**fields))

    qwen = model(
        model_type="qwen3_moe",
        num_hidden_layers=6,
        num_experts=8,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    assert moe_layer_count(qwen) == 2  # layers 1 and 5 (3 is dense by mlp_only_layers)
    deepseek = model(
        model_type="deepseek_v3",
        num_hidden_layers=61,
        n_routed_experts=256,
        first_k_dense_replace=3,
        moe_layer_freq=1,
    )
    assert moe_layer_count(deepseek) == 58
    llama4 = model(model_type="llama4_text", num_hidden_layers=48, interleave_moe_layer_step=2)
    assert moe_layer_count(llama4) == 24
    assert moe_layer_count(model(model_type="mixtral", num_hidden_layers=32)) == 32
    unknown = model(model_type="something_new", num_hidden_layers=7)
    assert moe_layer_count(unknown) is None and hidden_layer_count(unknown) == 7


def test_a_metrics_directory_deleted_while_serving_is_created_again(tmp_path):
    import shutil

    from eplb_graph.integrations.vllm.metrics import RankMetricsFile

    directory = tmp_path / "metrics"
    file = RankMetricsFile(str(directory), 0)
    shutil.rmtree(directory)
    assert file.update((1,), lambda: {"steps": 1}) is True
    assert json.loads((directory / "rank0.json").read_text())["steps"] == 1


def test_metrics_write_failures_warn_once_per_interval_with_a_count(tmp_path, monkeypatch, caplog):
    import shutil

    from eplb_graph.integrations.vllm import metrics

    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    directory = tmp_path / "metrics"
    file = metrics.RankMetricsFile(str(directory), 0)
    shutil.rmtree(directory)
    directory.write_text("")  # a file where the directory was: it cannot be created again
    with caplog.at_level("WARNING", logger=metrics.logger.name):
        for step in range(100):
            assert file.update((step,), lambda: {}) is False
        assert len(caplog.records) == 1 and "cannot write metrics" in caplog.records[0].message
        clock[0] += metrics.WARN_INTERVAL_S
        file.update((100,), lambda: {})
    assert len(caplog.records) == 2
    assert "99 more like this in the last 60 s were not logged" in caplog.records[1].message


def test_compile_figures_are_reported_only_for_a_compiled_model():
    """An eager engine's Dynamo counters count other torch.compile users of the worker (2 graphs
    against 0 at the first step read as a recompile): it reports no graph figures."""
    from eplb_graph.integrations.vllm.metrics import (
        compile_counters,
        compile_figures,
        model_is_compiled,
    )

    def config(eager, mode):
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(enforce_eager=eager),
            compilation_config=types.SimpleNamespace(mode=mode),
        )

    assert not model_is_compiled(config(True, 3)) and not model_is_compiled(config(False, 0))
    assert model_is_compiled(config(False, 3))
    at_first_step = compile_counters()["unique_graphs"]
    assert compile_figures(True, at_first_step)["recompiled_while_serving"] is False
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(3))  # a graph after the start
    compiled = compile_figures(True, at_first_step)
    assert compiled["model_compiled"] and compiled["recompiled_while_serving"] is True
    assert compiled["unique_graphs"] > compiled["unique_graphs_at_first_step"]
    eager = compile_figures(False, None)
    assert eager["model_compiled"] is False
    assert all(eager[key] is None for key in eager if key != "model_compiled")


def test_the_background_writer_writes_off_the_calling_thread_and_flushes_at_close(tmp_path):
    import threading
    import time

    writers = []

    def document():
        writers.append(threading.current_thread().name)
        return {"rank": 0, "layers_committed": len(writers)}

    file = RankMetricsFile(str(tmp_path), 0)
    from eplb_graph.integrations.vllm.metrics import BackgroundWriter

    writer = BackgroundWriter(file, document)
    writer.notify((1,))
    writer.notify((1,))  # unchanged progress: nothing to do
    deadline = time.monotonic() + 10
    while not file.path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writers == ["eplb-metrics"]
    writer.close((2,))
    assert writers[-1] == threading.current_thread().name  # the final write is synchronous
    assert json.loads(file.path.read_text())["layers_committed"] == 2


_PHASE_SPELLINGS = {
    "vllm-ascend": {"eplb_config": {"load_collection_phase": "prefill"}},
    "eplb-graph": {"eplb_graph": {"load_collection_phase": "prefill"}},
    "both, equal": {
        "eplb_config": {"load_collection_phase": "prefill"},
        "eplb_graph": {"load_collection_phase": "prefill"},
    },
}


@pytest.mark.vllm
def test_min_gain_percent_reaches_the_planner(engine_args):
    from eplb_graph.integrations.vllm.settings import eplb_settings

    config = engine_args(
        additional_config={"eplb_graph": {"min_gain_percent": 5}}
    ).create_engine_config()
    assert eplb_settings(config, num_layers=2).min_gain_percent == 5
    default = eplb_settings(engine_args().create_engine_config(), num_layers=2)
    assert default.min_gain_percent == 0


@pytest.mark.vllm
def test_rearrange_defaults_to_when_it_pays_where_the_experts_are_timed(engine_args):
    """A user who turns EPLB on and forgets it gets the payback gate on vLLM's CPU kernels;
    vllm-ascend's NPU kernels record no time, so there the default is ``always`` and asking for
    the gate fails at start-up."""
    from eplb_graph.integrations.vllm.settings import ConfigError, eplb_settings

    default = engine_args().create_engine_config()
    assert eplb_settings(default, num_layers=2).rearrange == "when_it_pays"
    assert eplb_settings(default, num_layers=2, timed_experts=False).rearrange == "always"
    always = engine_args(additional_config={"eplb_graph": {"rearrange": "always"}})
    assert eplb_settings(always.create_engine_config(), num_layers=2).rearrange == "always"
    gate = engine_args(additional_config={"eplb_graph": {"rearrange": "when_it_pays"}})
    with pytest.raises(ConfigError, match=r"eplb_graph\.rearrange.*do not record"):
        eplb_settings(gate.create_engine_config(), num_layers=2, timed_experts=False)


@pytest.mark.vllm
def test_record_windows_needs_a_metrics_path_and_names_the_file(engine_args, tmp_path):
    from eplb_graph.integrations.vllm.settings import eplb_settings

    with pytest.raises(ConfigError, match="needs metrics_path") as info:
        PluginOptions.from_section({"record_windows": True})
    assert info.value.field == f"{PREFIX}.record_windows"
    section = {"record_windows": True, "metrics_path": str(tmp_path / "metrics")}
    config = engine_args(additional_config={"eplb_graph": section}).create_engine_config()
    control = eplb_settings(config, num_layers=2)
    assert control.windows_path == str(tmp_path / "metrics" / "windows.jsonl")
    assert eplb_settings(engine_args().create_engine_config(), num_layers=2).windows_path is None


@pytest.mark.vllm
@pytest.mark.parametrize("spelling", list(_PHASE_SPELLINGS))
def test_each_load_collection_phase_spelling_filters_the_load(engine_args, spelling):
    from eplb_graph.control import EplbController
    from eplb_graph.integrations.vllm.settings import eplb_settings

    config = engine_args(additional_config=_PHASE_SPELLINGS[spelling]).create_engine_config()
    control = eplb_settings(config, num_layers=2)
    state = eplb_graph.EplbState(eplb_graph.Placement.default(2, 8, 2, 2))
    controller = EplbController(state, control, lambda snapshot: None)
    recorded = []
    for has_prefill in (False, True):  # before the first window close (step_interval 8 // 4)
        state.load.fill_(1)
        controller.begin_step(has_prefill=has_prefill, num_valid_tokens=4)
        recorded.append(bool(state.record_enabled))
        controller.end_step()
    assert recorded == [False, True]  # only the prefill batch feeds the window


@pytest.mark.vllm
def test_two_different_load_collection_phases_are_refused_naming_both(engine_args):
    additional = {
        "eplb_config": {"load_collection_phase": "prefill"},
        "eplb_graph": {"load_collection_phase": "decode"},
    }
    with pytest.raises(ConfigError) as info:
        engine_args(additional_config=additional).create_engine_config()
    assert info.value.field == f"{PREFIX}.load_collection_phase"
    message = str(info.value)
    assert "'decode'" in message and "'prefill'" in message
    assert "additional_config.eplb_config.load_collection_phase" in message


def test_the_metrics_file_is_refreshed_while_serving_without_eplb_events(tmp_path):
    """Steps served between windows reach the file within the refresh period (issue 19)."""
    import time

    from eplb_graph.integrations.vllm.metrics import BackgroundWriter

    steps = [0]
    file = RankMetricsFile(str(tmp_path), 0)
    writer = BackgroundWriter(
        file, lambda: {"rank": 0, "steps": steps[0]}, heartbeat=lambda: steps[0], refresh_s=0.05
    )
    try:
        for expected in (1, 5):
            steps[0] = expected  # served steps, no progress notified
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if file.path.exists() and json.loads(file.path.read_text())["steps"] == expected:
                    break
                time.sleep(0.02)
            assert json.loads(file.path.read_text())["steps"] == expected
    finally:
        writer.close((0,))


def test_a_figure_without_samples_says_so():
    from eplb_graph.integrations.vllm.runner import _summary

    assert _summary([]) == {"count": 0, "p50": None, "p99": None}
    assert _summary([0.001, 0.003])["count"] == 2


def test_the_checkpoint_command_writes_a_servable_skewed_model(tmp_path):
    """``eplb-graph checkpoint OUT --zipf S``: a Qwen3-MoE folder whose router follows the skew."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from eplb_graph.cli import main

    assert main(["checkpoint", str(tmp_path / "flat"), "--zipf", "0"]) == 0
    assert main(["checkpoint", str(tmp_path / "zipf"), "--zipf", "1.5"]) == 0
    config = json.loads((tmp_path / "zipf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 8
    key = "model.layers.0.mlp.gate.weight"
    flat = load_file(tmp_path / "flat" / "model.safetensors")[key]
    skewed = load_file(tmp_path / "zipf" / "model.safetensors")[key]
    ratio = skewed.norm(dim=1) / flat.norm(dim=1)  # same seed: only the skew differs
    order = [2, 3, 4, 0, 1, 5, 6, 7]  # hot experts first
    assert ratio[order].tolist() == sorted(ratio.tolist(), reverse=True)
    assert float(ratio[2] / ratio[7]) == pytest.approx(8**1.5, rel=1e-4)
    assert main(["checkpoint", str(tmp_path / "bad"), "--zipf", "-1"]) == 2
