"""The on-disk trace cache: real traces of a tiny megatron-core GPT stored, read back, keyed, rebuilt."""

import dataclasses
import gzip
import json
import marshal
import logging
import os

import pytest

from vtrain_plugin.capture import disk_cache, megatron_chunk, tracer
from vtrain_plugin.capture.chunk import ChunkTrace, named_shape_key, shape_key
from vtrain_plugin.capture.tracer import clear_cache, trace
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.core.graph import Block, BlockKind
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

MODEL = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
PLAN = ParallelPlan(tensor_parallel=2)
KEY = shape_key(MODEL, PLAN, True, True, 2)  # the one chunk of PLAN: TP 2, one stage, both layers built
# Each changes the key of KEY's chunk (a field of the model or the plan it depends on).
MODEL_VARIANTS = {"family": "llama", "hidden_size": 128, "num_attention_heads": 8, "seq_length": 64,
                  "vocab_size": 256, "ffn_hidden_size": 128, "num_query_groups": 2, "tied_embeddings": False,
                  "dtype": "bf16", "num_experts": 4}
# Each changes the key of a MoE model's chunk (the fields a dense model must leave unset).
MOE_MODEL = dataclasses.replace(MODEL, num_experts=4)
MOE_MODEL_VARIANTS = {"moe_router_topk": 1, "moe_ffn_hidden_size": 128, "moe_routing_skew": 2.0,
                      "moe_shared_expert_intermediate_size": 128,
                      "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.0,
                      "moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "position",
                      "moe_router_load_balancing_type": "sinkhorn", "moe_router_dtype": "fp32",
                      "moe_router_pre_softmax": True}
# MoE fields that need another set with them (each also changes the key; see test_moe_features_key).
MOE_FIELDS_WITH_OTHERS = {"moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
                          "moe_pad_expert_input_to_capacity"}
# MoE fields that change how a trace is costed, not the trace (chunk.COSTED_MODEL_FIELDS).
MOE_COSTED = {"moe_grouped_gemm": True, "moe_shared_expert_overlap": True, "moe_permute_fusion": True,
              "moe_router_fusion": True}
# The MoE layer pattern picks the kinds of the layers each chunk builds (a field of the key), not the model's.
MOE_PATTERN = {"moe_layer_freq": 2}
MODEL_FIELDS_REFUSED = MOE_FIELDS_WITH_OTHERS | set(MOE_PATTERN) | set(MOE_COSTED)
# The layer's choices beyond the family (each changes the key of a gpt chunk; at its default the key
# is the family's, asserted below).
LAYER_VARIANTS = {"kv_channels": 32, "normalization": "RMSNorm", "activation": "squared_relu",
                  "gated_linear_unit": True, "add_bias_linear": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                  "position_embedding_type": "rope", "qk_layernorm": True, "qk_l2_norm": True}
ROPE_MODEL = dataclasses.replace(MODEL, position_embedding_type="rope")
NO_BIAS_MODEL = dataclasses.replace(MODEL, add_bias_linear=False)
GLU_MODEL = dataclasses.replace(MODEL, gated_linear_unit=True)
GLU_VARIANTS = {"glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0}
# Each changes the key of a Mamba hybrid's chunk (the fields a transformer must leave unset).
HYBRID_MODEL = dataclasses.replace(MODEL, hybrid_layer_pattern="M*", mamba_head_dim=16, mamba_num_groups=2)
HYBRID_MODEL_VARIANTS = {"hybrid_layer_pattern": "*M", "mamba_state_dim": 32, "mamba_head_dim": 32,
                         "mamba_num_groups": 4, "mamba_num_heads": 4}
# Each changes the key of a (multi-latent, windowed) attention model's chunk; off, they are not in the key.
ATTENTION_MODEL = dataclasses.replace(MODEL, family="llama", multi_latent_attention=True, window_size=(8, 0))
ATTENTION_VARIANTS = {"multi_latent_attention": False, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_head_dim": 8,
                      "qk_pos_emb_head_dim": 8, "v_head_dim": 8, "window_size": (4, 0), "window_attn_skip_freq": 2,
                      "softmax_type": "learnable", "mtp_num_layers": 1}
PLAN_VARIANTS = {"tensor_parallel": 4, "sequence_parallel": True, "micro_batch_size": 2, "recompute": "full",
                 "pipeline_parallel": 2, "context_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1,
                 "moe_token_dispatcher": "allgather"}
# Fields that do not change a chunk's trace, so plans that differ only in them share it.
MODEL_FIELDS_NOT_IN_KEY = {"num_layers": 8, "name": "other", "layernorm_zero_centered_gamma": True}
PLAN_FIELDS_NOT_IN_KEY = {"data_parallel": 16, "account_for_embedding_in_pipeline_split": True,
                          "account_for_loss_in_pipeline_split": True,
                          "cp_comm_type": "all_gather",  # the CP attention is derived when costing
                          "tp_pp_dp_mapping": True,  # the rank order: where groups are placed, not their ops
                          "distributed_optimizer_instances": 2}  # how the optimizer is sharded, not its ops
# Uneven first / last stages (they need several stages) pick each chunk's layer count, i.e. the
# layers built (a field of the key), not the trace of a chunk role.
UNEVEN_SPLIT_NOT_IN_KEY = {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 1}
# The flex dispatcher's kernels and the EP overlap change how a MoE chunk is costed, not its trace.
EP_PLAN = ParallelPlan(data_parallel=2, expert_parallel=2)
EP_COMM_NOT_IN_KEY = {"moe_flex_dispatcher_backend": "hybridep", "moe_flex_num_sms": 24,
                      "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
# A layout picks each chunk's layer count as those do (Et|tL: one layer per stage of PP 2).
LAYOUT_NOT_IN_KEY = {"pipeline_layout": "Et|tL"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(folder))
    clear_cache()
    yield folder
    clear_cache()


def _forbid_tracing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("traced although the disk cache holds the chunk")
    monkeypatch.setattr(megatron_chunk, "trace_chunk", fail)


def _graph_json(graph) -> str:
    return json.dumps(graph.to_dict(), sort_keys=True)


def _entries(folder):
    return sorted((folder / "traces").glob(f"*{disk_cache.SUFFIX}"))


def test_a_hit_gives_the_identical_graph_and_estimate(cache_dir, monkeypatch):
    traced = trace(MODEL, PLAN)
    assert [p.name for p in _entries(cache_dir)] == [disk_cache.entry_path(KEY).name]
    clear_cache()
    _forbid_tracing(monkeypatch)
    read = trace(MODEL, PLAN)
    assert _graph_json(read) == _graph_json(traced)
    cluster, training = get_cluster_preset("dgx-a100"), TrainingSpec(global_batch_size=8)
    assert estimate(read, cluster=cluster, training=training).to_dict() == \
        estimate(traced, cluster=cluster, training=training).to_dict()


def test_plans_that_share_a_shape_share_the_entry(cache_dir, monkeypatch):
    trace(MODEL, PLAN)
    clear_cache()
    _forbid_tracing(monkeypatch)
    graph = trace(dataclasses.replace(MODEL, num_layers=8, name="deeper"), dataclasses.replace(PLAN, data_parallel=4))
    assert graph.stages[0].num_layers == 8
    assert len(_entries(cache_dir)) == 1


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "not gzip", "not marshal", "foreign", "malformed"])
def test_a_damaged_or_foreign_entry_is_ignored_and_rebuilt(cache_dir, damage, caplog):
    expected = _graph_json(trace(MODEL, PLAN))
    path = disk_cache.entry_path(KEY)
    data = path.read_bytes()
    entry = marshal.loads(gzip.decompress(data))
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":
        path.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:])
    elif damage == "not gzip":
        path.write_bytes(b"\x00garbage" * 10)
    elif damage == "not marshal":
        path.write_bytes(gzip.compress(b"\xffgarbage" * 10))
    elif damage == "foreign":  # another version's entry under this name (a hash collision)
        entry["key"]["versions"]["torch"] = "0.0.1"
        path.write_bytes(gzip.compress(marshal.dumps(entry)))
    else:
        del entry["chunk"]["blocks"]
        path.write_bytes(gzip.compress(marshal.dumps(entry)))
    clear_cache()
    with caplog.at_level(logging.DEBUG, logger="vtrain_plugin.capture.disk_cache"):
        assert disk_cache.load(KEY) is None
        assert _graph_json(trace(MODEL, PLAN)) == expected
    assert any("ignoring" in r.message and r.levelno == logging.DEBUG for r in caplog.records)
    assert disk_cache.load(KEY) is not None  # rewritten whole


def test_no_cache_reads_and_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("VTRAIN_NO_CACHE", "1")
    trace(MODEL, PLAN)
    assert not (cache_dir / "traces").exists()
    monkeypatch.setenv("VTRAIN_NO_CACHE", "maybe")
    with pytest.raises(ConfigError, match="VTRAIN_NO_CACHE must be one of 1, true, yes, on .* got 'maybe'"):
        disk_cache.enabled()


def test_the_key_covers_every_field_that_shapes_the_trace():
    """Every field of ModelSpec and ParallelPlan either changes the key or is listed as not shaping
    a chunk's trace: a new field fails here until it is classified."""
    model_fields = {f.name for f in dataclasses.fields(ModelSpec)}
    plan_fields = {f.name for f in dataclasses.fields(ParallelPlan)}
    assert model_fields == (set(MODEL_VARIANTS) | set(MOE_MODEL_VARIANTS) | set(HYBRID_MODEL_VARIANTS)
                            | set(MODEL_FIELDS_NOT_IN_KEY) | MODEL_FIELDS_REFUSED | set(LAYER_VARIANTS)
                            | {"rotary_percent", "add_qkv_bias"} | set(GLU_VARIANTS) | set(ATTENTION_VARIANTS)
                            | {"no_rope_freq"})
    llama = dataclasses.replace(MODEL, family="llama")  # NoPE layers skip RoPE, which a llama has
    assert shape_key(dataclasses.replace(llama, no_rope_freq=1), PLAN, True, True, 2) != \
        shape_key(llama, PLAN, True, True, 2)
    assert "no_rope_freq" not in named_shape_key(shape_key(llama, PLAN, True, True, 2))["model"]
    assert plan_fields == (set(PLAN_VARIANTS) | set(PLAN_FIELDS_NOT_IN_KEY) | set(UNEVEN_SPLIT_NOT_IN_KEY)
                           | {"virtual_pipeline", "recompute_modules"} | set(LAYOUT_NOT_IN_KEY)
                           | {"hierarchical_context_parallel_sizes"}  # like cp_comm_type: derived when costing
                           | set(EP_COMM_NOT_IN_KEY))
    assert shape_key(MOE_MODEL, dataclasses.replace(EP_PLAN, **EP_COMM_NOT_IN_KEY), True, True, 2) == \
        shape_key(MOE_MODEL, EP_PLAN, True, True, 2)
    paths = {disk_cache.entry_path(KEY)}
    for name, value in MODEL_VARIANTS.items():
        model = dataclasses.replace(MODEL, **{name: value})
        paths.add(disk_cache.entry_path(shape_key(model, PLAN, True, True, 2)))
    for name, value in MOE_MODEL_VARIANTS.items():
        model = dataclasses.replace(MOE_MODEL, **{name: value})
        paths.add(disk_cache.entry_path(shape_key(model, PLAN, True, True, 2)))
    paths.add(disk_cache.entry_path(shape_key(HYBRID_MODEL, PLAN, True, True, 2)))
    for name, value in HYBRID_MODEL_VARIANTS.items():
        model = dataclasses.replace(HYBRID_MODEL, **{name: value})
        paths.add(disk_cache.entry_path(shape_key(model, PLAN, True, True, 2)))
    for name, value in PLAN_VARIANTS.items():
        paths.add(disk_cache.entry_path(shape_key(MODEL, dataclasses.replace(PLAN, **{name: value}), True, True, 2)))
    paths |= {disk_cache.entry_path(shape_key(MODEL, PLAN, *role)) for role in
              ((True, False, 2), (False, True, 2), (True, True, 1))}
    for name, value in LAYER_VARIANTS.items():
        paths.add(disk_cache.entry_path(shape_key(dataclasses.replace(MODEL, **{name: value}), PLAN, True, True, 2)))
    paths.add(disk_cache.entry_path(shape_key(dataclasses.replace(ROPE_MODEL, rotary_percent=0.5), PLAN, True, True, 2)))
    paths.add(disk_cache.entry_path(shape_key(dataclasses.replace(NO_BIAS_MODEL, add_qkv_bias=True), PLAN, True, True, 2)))
    for name, value in GLU_VARIANTS.items():
        paths.add(disk_cache.entry_path(shape_key(dataclasses.replace(GLU_MODEL, **{name: value}), PLAN, True, True, 2)))
    # selective recompute of core attention (the default modules) and of the MLP besides
    for modules in (None, ("core_attn", "mlp")):
        selective = dataclasses.replace(PLAN, recompute="selective", recompute_modules=modules)
        paths.add(disk_cache.entry_path(shape_key(MODEL, selective, True, True, 2)))
    for name, value in ATTENTION_VARIANTS.items():
        model = dataclasses.replace(ATTENTION_MODEL, **{name: value})
        paths.add(disk_cache.entry_path(shape_key(model, PLAN, True, True, 2)))
    assert len(paths) == (1 + len(MODEL_VARIANTS) + len(MOE_MODEL_VARIANTS) + 1 + len(HYBRID_MODEL_VARIANTS)
                          + len(PLAN_VARIANTS) + 3 + len(LAYER_VARIANTS) + 2 + len(GLU_VARIANTS) + 2
                          + len(ATTENTION_VARIANTS))
    # off, the attention variants leave a model's key as it was before they existed
    assert not set(ATTENTION_VARIANTS) & set(named_shape_key(KEY)["model"])
    # the family's own choices spelled out: the family's key, as before the fields existed
    gpt = dict(normalization="LayerNorm", activation="gelu", gated_linear_unit=False, add_bias_linear=True,
               hidden_dropout=0.1, attention_dropout=0.1, position_embedding_type="learned_absolute",
               kv_channels=16, rotary_percent=1.0, add_qkv_bias=True, qk_layernorm=False, qk_l2_norm=False)
    assert shape_key(dataclasses.replace(MODEL, **gpt), PLAN, True, True, 2) == KEY
    assert dict(KEY[0]).keys() == {"family", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                                   "ffn_hidden_size", "num_query_groups", "tied_embeddings", "dtype", "num_experts",
                                   "moe_router_topk", "moe_ffn_hidden_size", "moe_routing_skew",
                                   "moe_shared_expert_intermediate_size"}
    same = [shape_key(dataclasses.replace(MODEL, **MODEL_FIELDS_NOT_IN_KEY), PLAN, True, True, 2),
            shape_key(MODEL, dataclasses.replace(PLAN, **PLAN_FIELDS_NOT_IN_KEY), True, True, 2)]
    assert all(k == KEY for k in same)
    moe_key = shape_key(MOE_MODEL, PLAN, True, True, 2)
    assert shape_key(dataclasses.replace(MOE_MODEL, **MOE_PATTERN), PLAN, True, True, 2) == moe_key
    shared = dataclasses.replace(MOE_MODEL, moe_shared_expert_intermediate_size=128)
    assert shape_key(dataclasses.replace(shared, **MOE_COSTED), PLAN, True, True, 2) == \
        shape_key(shared, PLAN, True, True, 2)
    assert shape_key(MOE_MODEL, PLAN, True, True, (False, True)) != moe_key
    # pipeline and virtual pipeline sizes beyond "several stages" only pick the chunk role
    pp2, pp8 = (ParallelPlan(tensor_parallel=2, pipeline_parallel=p, virtual_pipeline=v) for p, v in ((2, 1), (8, 2)))
    assert shape_key(MODEL, pp2, False, True, 2) == shape_key(MODEL, pp8, False, True, 2)
    uneven = dataclasses.replace(pp2, **UNEVEN_SPLIT_NOT_IN_KEY)
    assert shape_key(MODEL, uneven, False, True, 1) == shape_key(MODEL, pp2, False, True, 1)
    laid_out = dataclasses.replace(pp2, **LAYOUT_NOT_IN_KEY)
    assert shape_key(MODEL, laid_out, False, True, 1) == shape_key(MODEL, pp2, False, True, 1)


@pytest.mark.parametrize("package", ["vtrain", "torch", "megatron-core"])
def test_the_key_changes_with_the_versions(monkeypatch, package):
    before = disk_cache.entry_path(KEY)
    real = disk_cache._package_version
    monkeypatch.setattr(disk_cache, "_package_version", lambda name: "9.9" if name == package else real(name))
    assert disk_cache.entry_path(KEY) != before
    assert disk_cache.entry_key(KEY)["versions"][package] == "9.9"


def test_the_versions_in_the_key_are_the_installed_ones():
    """Read from the dist-info folders' names, without importlib.metadata: the same answers."""
    from importlib import metadata

    for package in ("vtrain", "torch", "megatron-core", "numpy"):
        assert disk_cache._package_version(package) == metadata.version(package)
    assert disk_cache._package_version("no-such-package-of-vtrain") is None


def test_the_key_changes_with_the_traced_code(monkeypatch):
    before = disk_cache.entry_path(KEY)
    monkeypatch.setattr(disk_cache, "_traced_code_digest", lambda: "edited")
    assert disk_cache.entry_path(KEY) != before


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("VTRAIN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.traces_dir() == tmp_path / "xdg" / "vtrain" / "traces"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert disk_cache.traces_dir() == tmp_path / "home" / ".cache" / "vtrain" / "traces"
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(tmp_path / "mine"))
    assert disk_cache.traces_dir() == tmp_path / "mine" / "traces"


def _small_chunk(name: str) -> ChunkTrace:
    return ChunkTrace(blocks=(Block(kind=BlockKind.STAGE, name=name),), params_by_block={name: (1,)},
                      expert_params_by_block={},
                      word_embedding_params=0, activation_shape=(1, 2, 3), activation_dtype="float16")


def test_least_recently_used_entries_go_above_the_size_limit(cache_dir, monkeypatch):
    keys = [shape_key(dataclasses.replace(MODEL, hidden_size=64 * (i + 1)), PLAN, True, True, 2) for i in range(4)]
    for i, key in enumerate(keys[:3]):
        disk_cache.store(key, _small_chunk(f"chunk{i}"))
        os.utime(disk_cache.entry_path(key), (1000 + i, 1000 + i))
    assert disk_cache.load(keys[0]) is not None  # a hit makes the oldest the most recently used
    size = disk_cache.entry_path(keys[0]).stat().st_size
    monkeypatch.setenv("VTRAIN_CACHE_MAX_MB", str(3.5 * size / 1e6))
    disk_cache.store(keys[3], _small_chunk("chunk3"))
    assert [disk_cache.entry_path(k).exists() for k in keys] == [True, False, True, True]
    assert disk_cache.info().entries == 3
    monkeypatch.setenv("VTRAIN_CACHE_MAX_MB", "-1")
    with pytest.raises(ConfigError, match="VTRAIN_CACHE_MAX_MB must be positive and finite, got -1"):
        disk_cache.max_bytes()


def test_an_unwritable_cache_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("VTRAIN_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING):
        disk_cache.store(KEY, _small_chunk("x"))
    assert "could not write" in caplog.text
    assert disk_cache.load(KEY) is None


def test_moe_features_set_together_change_the_key_and_unset_ones_keep_it():
    """A MoE feature left at its default is not in the key, so a model without it keeps its cached
    traces; one set is."""
    key = shape_key(MOE_MODEL, PLAN, True, True, 2)
    named = disk_cache.entry_key(key)["shape"]["model"]
    assert set(named) == {"family", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                          "ffn_hidden_size", "num_query_groups", "tied_embeddings", "dtype", "num_experts",
                          "moe_router_topk", "moe_ffn_hidden_size", "moe_routing_skew",
                          "moe_shared_expert_intermediate_size"}
    together = [dict(moe_router_num_groups=2, moe_router_group_topk=1),
                dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
                dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)]
    keys = {shape_key(dataclasses.replace(MOE_MODEL, **fields), PLAN, True, True, 2) for fields in together}
    assert len(keys) == len(together) and key not in keys


def test_trace_jobs_look_each_shape_up_once_and_ignore_repeated_plans(cache_dir):
    """A search hands trace_jobs one plan per candidate (about 100,000 for `vtrain size`'s smallest
    shape, 28,554 distinct, far fewer shape keys): repeats add no job, and no shape is in two jobs."""
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
    plans = [ParallelPlan(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, micro_batch_size=b,
                          recompute=recompute)
             for tp in (1, 2) for pp in (1, 2) for dp in (1, 2, 4) for b in (1, 2, 4, 8) for recompute in ("none", "full")]
    jobs = tracer.trace_jobs(model, plans)
    assert jobs == tracer.trace_jobs(model, [plan for plan in plans for _ in range(3)])
    keys = [shape_key(model, plan, *job.role) for job in jobs for plan in job.plans]
    assert len(keys) == len(set(keys)) == len({shape_key(model, plan, *role) for plan in plans
                                               for role in tracer._roles(model, plan, tracer._plan_chunks(model, plan),
                                                                         tracer.DEFAULT_TRACED_LAYERS)})


def test_entries_read_share_their_equal_node_tuples(cache_dir):
    trace(MODEL, PLAN)
    chunk = disk_cache.load(KEY)
    other = shape_key(MODEL, PLAN, True, True, 1)  # another entry holding equal blocks
    disk_cache.store(other, chunk)
    first, second = disk_cache.load(KEY), disk_cache.load(other)
    assert first.blocks == chunk.blocks and second.blocks == chunk.blocks
    assert all(a.nodes is b.nodes for a, b in zip(first.blocks, second.blocks))
    layers = [b for b in first.blocks if b.kind is BlockKind.LAYER]
    assert len(layers) == 2 and layers[0].nodes != first.blocks[0].nodes  # unequal tuples stay apart
    assert {id(b.nodes) for b in first.blocks} == {id(n) for n in {b.nodes: b.nodes for b in first.blocks}.values()}


def test_a_process_that_keeps_its_reads_frozen_freezes_each_entry(cache_dir, monkeypatch):
    import gc

    trace(MODEL, PLAN)
    before = gc.get_freeze_count()  # the test session's own (tests/conftest.py), left frozen
    disk_cache.load(KEY)
    assert gc.get_freeze_count() == before  # by default a read leaves the collector as it was
    monkeypatch.setattr(disk_cache, "_freeze_reads", True)
    assert disk_cache.load(KEY) is not None
    assert gc.get_freeze_count() > before and gc.isenabled()
