"""How one model replica is split and replicated, and the per-rank batch shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs import limits
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.pipeline_split import chunk_layers_error, rank_layers_error, stage_layers


class CpCommType(StrEnum):
    """How context-parallel attention exchanges keys and values (TransformerEngine's ``cp_comm_type``)."""

    P2P = "p2p"  # ring: each step sends the K/V chunk to the next CP rank, overlapped with attention
    ALL_GATHER = "all_gather"  # all-gather of K/V before attention, reduce-scatter of dK/dV after
    A2A = "a2a"  # DeepSpeed-Ulysses: Q, K, V all-to-all from sequence- to head-sharded, the output back
    A2A_P2P = "a2a+p2p"  # a2a inside the first level of hierarchical_context_parallel_sizes, p2p across


class TokenDispatcher(StrEnum):
    """How a MoE layer moves tokens to the ranks of their experts (megatron-core's
    ``moe_token_dispatcher_type``)."""

    ALLTOALL = "alltoall"  # all-to-all over the EP group, all-gather / reduce-scatter over expert TP
    ALLGATHER = "allgather"  # all-gather of every token over expert TP x EP, reduce-scatter back
    FLEX = "flex"  # fused dispatch / combine over expert TP x EP (DeepEP or HybridEP kernels)


class FlexBackend(StrEnum):
    """The kernels of the flex dispatcher (megatron-core's ``moe_flex_dispatcher_backend``)."""

    DEEPEP = "deepep"
    HYBRIDEP = "hybridep"


# megatron-core's moe_deepep_num_sms and moe_hybridep_num_sms defaults: SMs the flex kernels occupy.
FLEX_DEFAULT_NUM_SMS = {FlexBackend.DEEPEP: 20, FlexBackend.HYBRIDEP: 16}


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # the recompute_modules of each layer (Megatron's --recompute-granularity selective)
    FULL = "full"  # every transformer layer, uniform, one layer per checkpoint


# megatron-core 0.16's recompute_modules, in its order; core_attn alone is its default.
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    """How one model replica is split and replicated, and the per-rank batch shape."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    sequence_parallel: bool = False
    virtual_pipeline: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    micro_batch_size: int = 1
    recompute: Recompute = Recompute.NONE
    # What selective recompute checkpoints in each layer (megatron-core's recompute_modules, see
    # RECOMPUTE_MODULES); None: its default, core attention. Set only with recompute "selective".
    recompute_modules: tuple[str, ...] | None = None
    # Uneven pipeline splits as Megatron-Core has them (see vtrain_plugin.specs.pipeline_split):
    # layers of the first / last pipeline rank (the rest spread over the middle ranks), or the
    # embedding and the loss each counted as one layer slot.
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Or Megatron-Core's layout string (pipeline_model_parallel_layout, e.g. "Et|(tt|)*30L"): each
    # virtual stage's embedding (E), layers (t) and loss (L), PP x VP stages in virtual-stage order.
    pipeline_layout: str | None = None
    # Context parallelism: each sequence split over context_parallel ranks (Megatron-Core's
    # context_parallel_size; see vtrain_plugin.cost.comm.context_parallel), K/V exchanged by cp_comm_type.
    context_parallel: int = 1
    cp_comm_type: CpCommType = CpCommType.P2P
    # The CP group's levels, innermost first (megatron-core's hierarchical_context_parallel_sizes, their
    # product the CP size); a2a+p2p runs its all-to-all over the first level and its ring over the second.
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    # MoE layers: experts split over expert_parallel ranks carved out of TP x CP x DP (megatron-core's
    # expert_model_parallel_size), each expert's FFN over expert_tensor_parallel ranks (None: the
    # tensor-parallel size, megatron-core's default); see expert_data_parallel.
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    moe_token_dispatcher: TokenDispatcher = TokenDispatcher.ALLTOALL
    # Ranks numbered tp-cp-ep-pp-dp instead of megatron-core's default tp-cp-ep-dp-pp (Megatron-LM's
    # --use-tp-pp-dp-mapping): pipeline stages of one replica sit closer, data-parallel peers farther.
    tp_pp_dp_mapping: bool = False
    # The flex dispatcher's kernels and the SMs they occupy (None: megatron-core's default for the
    # backend, FLEX_DEFAULT_NUM_SMS); see vtrain_plugin.cost.comm.moe_dispatch.
    moe_flex_dispatcher_backend: FlexBackend = FlexBackend.DEEPEP
    moe_flex_num_sms: int | None = None
    # megatron-core's combined 1F1B: the EP all-to-alls of one micro-batch's forward run beside
    # another's backward compute and vice versa; delay_wgrad_compute also moves the experts'
    # weight-gradient GEMMs after the backward dispatch so that they hide it (cost.comm.ep_overlap).
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    # megatron-core's partial distributed optimizer (Megatron-LM's --num-distributed-optimizer-instances):
    # the DP x CP ranks (and the expert DP ranks) split into this many instances of consecutive ranks;
    # each shards the optimizer state over its own ranks, and gradients reduce-scattered inside an
    # instance are all-reduced across instances (vtrain_plugin.cost.comm.dp_buckets). 1: one instance.
    distributed_optimizer_instances: int = 1

    def __post_init__(self) -> None:
        v.boolean("parallel.tp_pp_dp_mapping", self.tp_pp_dp_mapping)
        for name in ("tensor_parallel", "context_parallel", "pipeline_parallel", "data_parallel"):
            limits.WORLD_SIZE.positive_int(f"parallel.{name}", getattr(self, name))
        limits.WORLD_SIZE.check_derived(
            f"parallel.tensor_parallel ({self.tensor_parallel}) * context_parallel ({self.context_parallel}) "
            f"* pipeline_parallel ({self.pipeline_parallel}) * data_parallel ({self.data_parallel})", self.world_size)
        limits.NUM_LAYERS.positive_int("parallel.virtual_pipeline", self.virtual_pipeline)
        limits.MICRO_BATCH_SIZE.positive_int("parallel.micro_batch_size", self.micro_batch_size)
        object.__setattr__(self, "cp_comm_type", CpCommType(
            v.one_of("parallel.cp_comm_type", self.cp_comm_type, [c.value for c in CpCommType])))
        self._check_hierarchical_cp()
        v.boolean("parallel.sequence_parallel", self.sequence_parallel)
        limits.WORLD_SIZE.positive_int("parallel.expert_parallel", self.expert_parallel)
        if self.expert_tensor_parallel is not None:
            limits.WORLD_SIZE.positive_int("parallel.expert_tensor_parallel", self.expert_tensor_parallel)
        object.__setattr__(self, "moe_token_dispatcher", TokenDispatcher(v.one_of(
            "parallel.moe_token_dispatcher", str(self.moe_token_dispatcher), [d.value for d in TokenDispatcher])))
        self._check_moe_comm_fields()
        object.__setattr__(self, "recompute", Recompute(
            v.one_of("parallel.recompute", self.recompute, [r.value for r in Recompute])))
        self._check_recompute_modules()
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("parallel.sequence_parallel requires tensor_parallel > 1 (got 1)")
        if self.virtual_pipeline > 1 and self.pipeline_parallel == 1:
            raise ConfigError("parallel.virtual_pipeline > 1 requires pipeline_parallel > 1 (got 1)")
        self._check_split_fields()
        instances = limits.WORLD_SIZE.positive_int("parallel.distributed_optimizer_instances",
                                                   self.distributed_optimizer_instances)
        if self.grad_reduce_group_size % instances:
            raise ConfigError(f"parallel.distributed_optimizer_instances ({instances}) must divide data_parallel "
                              f"* context_parallel ({self.grad_reduce_group_size})")
        if self.expert_data_parallel % instances:
            raise ConfigError(f"parallel.distributed_optimizer_instances ({instances}) must divide the expert "
                              f"data-parallel size ({self.expert_data_parallel})")

    def _check_moe_comm_fields(self) -> None:
        """The flex dispatcher's settings and megatron-core's rules for the EP overlap (its
        TransformerConfig checks; those that need the model are LAYOUT_RULES)."""
        object.__setattr__(self, "moe_flex_dispatcher_backend", FlexBackend(v.one_of(
            "parallel.moe_flex_dispatcher_backend", str(self.moe_flex_dispatcher_backend),
            [b.value for b in FlexBackend])))
        if self.moe_flex_num_sms is not None:
            limits.WORLD_SIZE.positive_int("parallel.moe_flex_num_sms", self.moe_flex_num_sms)
        overlap = v.boolean("parallel.overlap_moe_expert_parallel_comm", self.overlap_moe_expert_parallel_comm)
        if v.boolean("parallel.delay_wgrad_compute", self.delay_wgrad_compute) and not overlap:
            raise ConfigError("parallel.delay_wgrad_compute requires parallel.overlap_moe_expert_parallel_comm "
                              "(megatron-core's rule)")
        if not overlap:
            return
        if self.expert_parallel == 1:
            raise ConfigError("parallel.overlap_moe_expert_parallel_comm requires expert_parallel > 1 (got 1)")
        if self.moe_token_dispatcher is TokenDispatcher.ALLGATHER:
            raise ConfigError("parallel.overlap_moe_expert_parallel_comm requires moe_token_dispatcher alltoall "
                              "or flex (got allgather)")
        if self.pipeline_parallel > 1 and self.virtual_pipeline == 1:
            raise ConfigError(f"parallel.overlap_moe_expert_parallel_comm with pipeline_parallel "
                              f"({self.pipeline_parallel}) > 1 requires virtual_pipeline > 1 (megatron-core "
                              f"overlaps the all-to-alls in the interleaved schedule only)")
        if self.recompute is Recompute.FULL:
            raise ConfigError("parallel.overlap_moe_expert_parallel_comm cannot be combined with recompute full "
                              "(megatron-core's rule)")

    def _check_hierarchical_cp(self) -> None:
        """hierarchical_context_parallel_sizes: positive sizes whose product is the CP size (megatron-core's
        assertion); a2a+p2p needs two levels (TransformerEngine takes its a2a and p2p groups from them)."""
        name, sizes = "parallel.hierarchical_context_parallel_sizes", self.hierarchical_context_parallel_sizes
        if sizes is None:
            if self.cp_comm_type is CpCommType.A2A_P2P:
                raise ConfigError(f"parallel.cp_comm_type a2a+p2p requires {name} (the a2a and p2p group sizes)")
            return
        if isinstance(sizes, str) or not isinstance(sizes, (list, tuple)) or not sizes:
            raise ConfigError(f"{name} must be a list of group sizes, got {sizes!r}")
        for size in sizes:
            limits.WORLD_SIZE.positive_int(name, size)
        sizes = tuple(sizes)
        object.__setattr__(self, "hierarchical_context_parallel_sizes", sizes)
        product = 1
        for size in sizes:
            product *= size
        if product != self.context_parallel:
            raise ConfigError(f"{name} ({' x '.join(map(str, sizes))} = {product}) must multiply to "
                              f"context_parallel ({self.context_parallel})")
        if self.cp_comm_type is CpCommType.A2A_P2P and len(sizes) != 2:
            raise ConfigError(f"{name} has {len(sizes)} levels; cp_comm_type a2a+p2p takes two (a2a size, p2p size)")

    @property
    def cp_a2a_size(self) -> int:
        """Ranks of the CP all-to-all (heads are split over them): the CP size under a2a, the first level
        of hierarchical_context_parallel_sizes under a2a+p2p, 1 otherwise."""
        if self.cp_comm_type is CpCommType.A2A:
            return self.context_parallel
        if self.cp_comm_type is CpCommType.A2A_P2P:
            return self.hierarchical_context_parallel_sizes[0]
        return 1

    @property
    def flex_num_sms(self) -> int:
        """SMs the flex dispatcher's kernels occupy: the one given, else megatron-core's default."""
        return self.moe_flex_num_sms or FLEX_DEFAULT_NUM_SMS[self.moe_flex_dispatcher_backend]

    def _check_recompute_modules(self) -> None:
        """recompute_modules: known names, only under selective recompute, stored in megatron-core's
        order without repeats, and as None when it is the default (one spelling per plan)."""
        modules = self.recompute_modules
        if modules is None:
            return
        if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
            raise ConfigError(f"parallel.recompute_modules must be a list of module names, got {modules!r}")
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(f"parallel.recompute_modules: {unknown[0]!r} is not one of {', '.join(RECOMPUTE_MODULES)}")
        if self.recompute is not Recompute.SELECTIVE:
            raise ConfigError(f"parallel.recompute_modules needs parallel.recompute selective "
                              f"(got {self.recompute.value})")
        if not modules:
            raise ConfigError("parallel.recompute_modules is empty: selective recompute needs at least one module")
        ordered = tuple(m for m in RECOMPUTE_MODULES if m in modules)
        object.__setattr__(self, "recompute_modules", None if ordered == DEFAULT_RECOMPUTE_MODULES else ordered)

    @property
    def recomputed_modules(self) -> tuple[str, ...]:
        """The modules selective recompute checkpoints in each layer (none without it; every layer
        whole under full recompute)."""
        if self.recompute is not Recompute.SELECTIVE:
            return ()
        return self.recompute_modules or DEFAULT_RECOMPUTE_MODULES

    def _check_split_fields(self) -> None:
        uneven = [name for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
                  if getattr(self, name) is not None]
        accounted = [name for name in ("account_for_embedding_in_pipeline_split",
                                       "account_for_loss_in_pipeline_split")
                     if v.boolean(f"parallel.{name}", getattr(self, name))]
        for name in uneven:
            v.positive_int(f"parallel.{name}", getattr(self, name))
            if self.pipeline_parallel == 1:
                raise ConfigError(f"parallel.{name} requires pipeline_parallel > 1 (got 1)")
        if uneven and accounted:
            raise ConfigError(f"parallel.{uneven[0]} cannot be combined with parallel.{accounted[0]} "
                              f"(Megatron-Core allows one form of uneven pipeline split)")
        if self.pipeline_layout is not None:
            v.string("parallel.pipeline_layout", self.pipeline_layout)
            if uneven or accounted:
                raise ConfigError(f"parallel.pipeline_layout cannot be combined with parallel.{(uneven + accounted)[0]} "
                                  f"(the layout places every layer, the embedding and the loss itself)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def grad_reduce_group_size(self) -> int:
        """Ranks a gradient is reduced over (and a distributed optimizer shards over): DP x CP, as
        Megatron-Core's data-parallel group with context parallelism (CP ranks hold the same
        weights and see different tokens of the same sequences)."""
        return self.data_parallel * self.context_parallel

    def local_seq_length(self, model: ModelSpec) -> int:
        """Tokens of each sequence on one context-parallel rank."""
        return model.seq_length // self.context_parallel

    @property
    def optimizer_shard_group_size(self) -> int:
        """Ranks one distributed-optimizer instance shards the dense optimizer state over: DP x CP /
        instances (megatron-core's intra_dp_cp_group)."""
        return self.grad_reduce_group_size // self.distributed_optimizer_instances

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size: the one given, else the tensor-parallel size."""
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    @property
    def expert_data_parallel(self) -> int:
        """Replicas of each expert shard: megatron-core lays the expert ranks (expert TP, EP, expert
        DP) over the same TP x CP x DP ranks of a pipeline stage as the dense ones, so expert DP is
        TP x CP x DP / (expert TP x EP) (the rule "(tp*cp*dp) % (ep*etp)" keeps it whole)."""
        return (self.tensor_parallel * self.context_parallel * self.data_parallel
                // (self.expert_parallel * self.expert_tp))

    @property
    def num_model_chunks(self) -> int:
        return self.pipeline_parallel * self.virtual_pipeline

    def check_fits(self, model: ModelSpec) -> None:
        """Raise ConfigError at the first of :data:`LAYOUT_RULES` this layout breaks for ``model``."""
        for rule in LAYOUT_RULES:
            if rule.broken(self, model):
                raise ConfigError(rule.message(self, model))
        limits.MICRO_BATCH_TOKENS.check_derived(
            f"micro_batch_size ({self.micro_batch_size}) * seq_length ({model.seq_length})",
            self.micro_batch_size * model.seq_length)

    def chunk_layers(self, model: ModelSpec) -> tuple[tuple[int, ...], ...]:
        """Transformer layers of ``[pipeline_rank][chunk]`` (see :mod:`vtrain_plugin.specs.pipeline_split`)."""
        return stage_layers(self, model)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recompute"] = self.recompute.value
        if self.recompute_modules is not None:
            d["recompute_modules"] = list(self.recompute_modules)
        d["cp_comm_type"] = self.cp_comm_type.value
        if self.hierarchical_context_parallel_sizes is not None:
            d["hierarchical_context_parallel_sizes"] = list(self.hierarchical_context_parallel_sizes)
        d["moe_token_dispatcher"] = self.moe_token_dispatcher.value
        d["moe_flex_dispatcher_backend"] = self.moe_flex_dispatcher_backend.value
        return d


@dataclass(frozen=True, slots=True)
class LayoutRule:
    """A rule a layout keeps to shard a model. ``name`` is the short label the plan search counts
    skipped plans under; ``message`` shows the arithmetic that failed."""

    name: str
    broken: Callable[[ParallelPlan, ModelSpec], bool]
    message: Callable[[ParallelPlan, ModelSpec], str]


def _divides(name: str, divisor: str, dividend: str, get_divisor: Callable[[ParallelPlan], int],
             get_dividend: Callable[[ModelSpec], int], when: Callable[[ParallelPlan], bool] = lambda p: True
             ) -> LayoutRule:
    return LayoutRule(
        name=name,
        broken=lambda p, m: when(p) and get_dividend(m) % get_divisor(p) != 0,
        message=lambda p, m: f"{divisor} ({get_divisor(p)}) must divide {dividend} ({get_dividend(m)})")


CP_LAYOUT_RULES: tuple[LayoutRule, ...] = (
    _divides("seq % cp", "context_parallel_size", "seq_length",
             lambda p: p.context_parallel, lambda m: m.seq_length),
    LayoutRule(
        name="seq % (2*cp)",
        broken=lambda p, m: p.context_parallel > 1 and m.seq_length % (2 * p.context_parallel) != 0,
        message=lambda p, m: (f"2 * context_parallel_size (2 * {p.context_parallel} = {2 * p.context_parallel}) "
                              f"must divide seq_length ({m.seq_length}): Megatron's load-balanced causal split "
                              f"gives each CP rank two chunks of seq / (2 * cp) tokens")),
    LayoutRule(
        name="seq/cp % tp (sp)",
        broken=lambda p, m: (p.sequence_parallel and p.context_parallel > 1
                             and (m.seq_length // p.context_parallel) % p.tensor_parallel != 0),
        message=lambda p, m: (f"tensor_parallel_size ({p.tensor_parallel}) must divide seq_length / "
                              f"context_parallel_size ({m.seq_length} / {p.context_parallel} = "
                              f"{m.seq_length // p.context_parallel}) with sequence parallelism")),
    # TransformerEngine's a2a splits each TP rank's query and key/value heads over the all-to-all group.
    LayoutRule(
        name="heads/tp % cp a2a",
        broken=lambda p, m: p.cp_a2a_size > 1 and (m.num_attention_heads // p.tensor_parallel) % p.cp_a2a_size != 0,
        message=lambda p, m: (f"the CP all-to-all group size ({p.cp_a2a_size}, cp_comm_type {p.cp_comm_type.value}) "
                              f"must divide the attention heads per tensor-parallel rank (num_attention_heads "
                              f"{m.num_attention_heads} / tensor_parallel_size {p.tensor_parallel} = "
                              f"{m.num_attention_heads // p.tensor_parallel})")),
    LayoutRule(
        name="query groups/tp % cp a2a",
        broken=lambda p, m: p.cp_a2a_size > 1 and (m.query_groups // p.tensor_parallel) % p.cp_a2a_size != 0,
        message=lambda p, m: (f"the CP all-to-all group size ({p.cp_a2a_size}, cp_comm_type {p.cp_comm_type.value}) "
                              f"must divide the key/value heads per tensor-parallel rank (num_query_groups "
                              f"{m.query_groups} / tensor_parallel_size {p.tensor_parallel} = "
                              f"{m.query_groups // p.tensor_parallel})")),
    # The CP attention is synthesized from a layer's score GEMM as causal attention over one head dim
    # (cost/comm/context_parallel.py): neither MLA's two head dims nor a window's scores yet.
    LayoutRule(
        name="cp with mla or windows",
        broken=lambda p, m: p.context_parallel > 1 and (m.multi_latent_attention or m.window_size is not None),
        message=lambda p, m: (f"context_parallel_size ({p.context_parallel}) with "
                              f"{'multi-latent attention' if m.multi_latent_attention else 'sliding-window attention'}"
                              f": context-parallel attention of that kind is not modelled by vtrain yet")),
    # The CP attention replaces the core attention of the folded layers only, not of the head's MTP layers.
    LayoutRule(
        name="cp with mtp",
        broken=lambda p, m: p.context_parallel > 1 and m.mtp_num_layers is not None,
        message=lambda p, m: (f"context_parallel_size ({p.context_parallel}) with multi-token prediction "
                              f"(mtp_num_layers {m.mtp_num_layers}) is not modelled by vtrain yet")),
)


MOE_LAYOUT_RULES: tuple[LayoutRule, ...] = (
    LayoutRule(
        name="ep needs moe",
        broken=lambda p, m: not m.is_moe and (p.expert_parallel > 1 or p.expert_tensor_parallel is not None),
        message=lambda p, m: (f"expert_parallel ({p.expert_parallel}) and expert_tensor_parallel "
                              f"({p.expert_tensor_parallel}) need a mixture-of-experts model (model.num_experts)")),
    _divides("experts % ep", "expert_parallel_size", "num_experts",
             lambda p: p.expert_parallel, lambda m: m.num_experts, when=lambda p: p.expert_parallel > 1),
    LayoutRule(
        name="(tp*cp*dp) % (ep*etp)",
        broken=lambda p, m: ((p.tensor_parallel * p.context_parallel * p.data_parallel)
                             % (p.expert_parallel * p.expert_tp) != 0),
        message=lambda p, m: (f"expert_parallel ({p.expert_parallel}) * expert_tensor_parallel ({p.expert_tp}) = "
                              f"{p.expert_parallel * p.expert_tp} must divide tensor_parallel ({p.tensor_parallel}) "
                              f"* context_parallel ({p.context_parallel}) * data_parallel ({p.data_parallel}) = "
                              f"{p.tensor_parallel * p.context_parallel * p.data_parallel}: "
                              f"the expert ranks of a pipeline stage are its TP x CP x DP ranks")),
    LayoutRule(
        name="moe ffn % etp",
        broken=lambda p, m: m.is_moe and m.expert_ffn_size % p.expert_tp != 0,
        message=lambda p, m: (f"expert_tensor_parallel ({p.expert_tp}) must divide moe_ffn_hidden_size "
                              f"({m.expert_ffn_size})")),
    LayoutRule(
        name="moe bias needs etp 1",
        broken=lambda p, m: m.is_moe and m.layer.add_bias_linear and p.expert_tp > 1,
        message=lambda p, m: (f"expert_tensor_parallel ({p.expert_tp}) must be 1 for a MoE model with linear biases "
                              f"(model.add_bias_linear): megatron-core supports expert linear biases only without "
                              f"expert TP")),
    LayoutRule(
        name="flex needs tp*ep > 1",
        broken=lambda p, m: (m.is_moe and p.moe_token_dispatcher is TokenDispatcher.FLEX
                             and p.expert_parallel * p.expert_tp == 1),
        message=lambda p, m: ("parallel.moe_token_dispatcher flex requires expert_parallel * expert_tensor_parallel "
                              "> 1 (megatron-core's rule)")),
    LayoutRule(
        name="ep overlap model",
        broken=lambda p, m: p.overlap_moe_expert_parallel_comm and _ep_overlap_error(m, p) is not None,
        message=lambda p, m: _ep_overlap_error(m, p) or ""),
    LayoutRule(
        name="moe tp needs sp",
        broken=lambda p, m: m.is_moe and p.tensor_parallel > 1 and not p.sequence_parallel,
        message=lambda p, m: (f"a mixture-of-experts model with tensor_parallel ({p.tensor_parallel}) > 1 needs "
                              f"sequence_parallel (megatron-core refuses to train MoE layers under TP without it)")),
)


def _ep_overlap_error(model: ModelSpec, plan: ParallelPlan) -> str | None:
    """What of ``model`` megatron-core refuses with overlap_moe_expert_parallel_comm, or None."""
    if model.moe_shared_expert_overlap:
        return "parallel.overlap_moe_expert_parallel_comm cannot be combined with model.moe_shared_expert_overlap"
    if model.dtype.value not in ("bf16", "fp16"):
        return f"parallel.overlap_moe_expert_parallel_comm requires a bf16 or fp16 model (got {model.dtype.value})"
    if model.mtp_num_layers is not None and model.mtp_num_layers > 1:
        return f"parallel.overlap_moe_expert_parallel_comm allows mtp_num_layers 1 at most (got {model.mtp_num_layers})"
    if model.mtp_num_layers == 1 and plan.pipeline_parallel == 1:
        return "parallel.overlap_moe_expert_parallel_comm with mtp_num_layers 1 requires pipeline_parallel > 1"
    return None

# What megatron-core 0.16's TransformerConfig asserts of recompute_modules against the model. A module
# the model lacks otherwise ("mlp" in an all-MoE model, "moe" in a dense one) is skipped by
# megatron-core, changes nothing and is accepted.
RECOMPUTE_LAYOUT_RULES: tuple[LayoutRule, ...] = (
    LayoutRule(
        name="recompute moe_act needs grouped gemm",
        broken=lambda p, m: "moe_act" in p.recomputed_modules and not m.moe_grouped_gemm,
        message=lambda p, m: ("parallel.recompute_modules moe_act needs model.moe_grouped_gemm (megatron-core "
                              "recomputes the expert activation of grouped-GEMM experts only)")),
    LayoutRule(
        name="recompute mla_up_proj needs mla",
        broken=lambda p, m: "mla_up_proj" in p.recomputed_modules and not m.multi_latent_attention,
        message=lambda p, m: "parallel.recompute_modules mla_up_proj needs model.multi_latent_attention"),
    LayoutRule(
        name="recompute shared_experts without overlap",
        broken=lambda p, m: "shared_experts" in p.recomputed_modules and m.moe_shared_expert_overlap,
        message=lambda p, m: ("parallel.recompute_modules shared_experts excludes model.moe_shared_expert_overlap "
                              "(megatron-core refuses it)")),
)


def _has_mamba(model: ModelSpec) -> bool:
    return "M" in (model.hybrid_layer_pattern or "")


# Mamba hybrids (vtrain_plugin/specs/hybrid.py): what megatron-core 0.16's MambaStack and mixer build.
HYBRID_LAYOUT_RULES: tuple[LayoutRule, ...] = (
    LayoutRule(
        name="hybrid vp",
        broken=lambda p, m: m.is_hybrid and p.virtual_pipeline > 1,
        message=lambda p, m: (f"virtual_pipeline ({p.virtual_pipeline}) must be 1 for a Mamba hybrid: "
                              f"megatron-core's MambaStack builds no interleaved pipeline")),
    LayoutRule(
        name="hybrid split slots",
        broken=lambda p, m: m.is_hybrid and (p.account_for_embedding_in_pipeline_split
                                             or p.account_for_loss_in_pipeline_split),
        message=lambda p, m: ("account_for_embedding/loss_in_pipeline_split must be off for a Mamba hybrid: "
                              "megatron-core's MambaStack splits its layers without embedding or loss slots")),
    LayoutRule(
        name="hybrid cp",
        broken=lambda p, m: m.is_hybrid and p.context_parallel > 1,
        message=lambda p, m: (f"context_parallel ({p.context_parallel}) in a Mamba hybrid: context parallelism "
                              f"of the Mamba mixer is not modelled by vtrain yet")),
    LayoutRule(
        name="mamba heads % tp",
        broken=lambda p, m: _has_mamba(m) and m.mamba_heads % p.tensor_parallel != 0,
        message=lambda p, m: f"tensor_parallel_size ({p.tensor_parallel}) must divide the Mamba heads ({m.mamba_heads})"),
    LayoutRule(
        name="mamba groups % tp",
        broken=lambda p, m: _has_mamba(m) and m.mamba_groups % p.tensor_parallel != 0,
        message=lambda p, m: (f"tensor_parallel_size ({p.tensor_parallel}) must divide mamba_num_groups "
                              f"({m.mamba_groups})")),
)


# In the order check_fits tests them (and the plan search reports them).
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    _divides("heads % tp", "tensor_parallel_size", "num_attention_heads",
             lambda p: p.tensor_parallel, lambda m: m.num_attention_heads),
    _divides("query groups % tp", "tensor_parallel_size", "num_query_groups",
             lambda p: p.tensor_parallel, lambda m: m.query_groups),
    _divides("ffn % tp", "tensor_parallel_size", "ffn_hidden_size",
             lambda p: p.tensor_parallel, lambda m: m.ffn_size),
    LayoutRule(name="layers % pp", broken=lambda p, m: rank_layers_error(p, m) is not None,
               message=rank_layers_error),
    LayoutRule(name="layers % (pp*vp)", broken=lambda p, m: chunk_layers_error(p, m) is not None,
               message=chunk_layers_error),
    _divides("seq % tp (sp)", "tensor_parallel_size", "seq_length",
             lambda p: p.tensor_parallel, lambda m: m.seq_length, when=lambda p: p.sequence_parallel),
    *CP_LAYOUT_RULES,
    *MOE_LAYOUT_RULES,
    *HYBRID_LAYOUT_RULES,
    *RECOMPUTE_LAYOUT_RULES,
)
