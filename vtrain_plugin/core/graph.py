"""The operator graph of one training iteration: the immutable data model everything else reads.

An :class:`OpGraph` holds one :class:`StageGraph` per model chunk (pipeline stage, times the
virtual-pipeline chunks). A stage is a sequence of :class:`Block` s (the embedding, the transformer
layer template with its repeat count, the output head); each block is an ordered tuple of nodes,
either an :class:`OpNode` (an aten op) or a :class:`CollectiveNode` (a c10d collective), each with its
phase and module. Nothing here carries simulation state: a simulation reads the graph and keeps its
own arrays, so one graph serves thousands of estimates.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Union

from vtrain_plugin.core.dtypes import Dtype

if TYPE_CHECKING:  # the specs layer sits above core; the graph only holds its values
    from vtrain_plugin.specs.model import ModelSpec
    from vtrain_plugin.specs.parallel import ParallelPlan

SCHEMA_VERSION = 8  # 2: model and parallel are specs, module_name names a plain module; 3: parameter_numels;
# 4: expert_parameter_numels; 5: the causal mask the layers' core attention keeps is a stage block of its own;
# 6: saved_by_module; 7: a stage's held and backward peak bytes; 8: both outside the core attention

Scalar = Union[int, float, bool, str, None]


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"


class CollectiveKind(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    SEND = "send"
    RECV = "recv"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


class ParallelGroup(StrEnum):
    TP = "tp"
    # The ranks gradients are reduced over: the data-parallel replicas times the context-parallel
    # ranks (Megatron-Core's data-parallel group with context parallelism; DP alone without CP).
    DP = "dp"
    PP = "pp"
    EMBEDDING = "embedding"
    CP = "cp"  # context parallelism: the ranks that split one sequence
    # Hierarchical CP (cp_comm_type a2a+p2p): the all-to-all over the first level of consecutive CP
    # ranks, the ring over the second (CP ranks a2a-size apart).
    CP_A2A = "cp_a2a"
    CP_P2P = "cp_p2p"
    # MoE layers (megatron-core's expert rank groups): experts over EP, each expert's FFN over expert
    # TP, the two together (the all-gather dispatcher's group), expert replicas over expert DP.
    EP = "ep"
    EXPERT_TP = "expert_tp"
    EXPERT_TP_EP = "expert_tp_ep"
    EXPERT_DP = "expert_dp"
    # Every rank of a pipeline stage (TP x CP x DP): the MoE router's global auxiliary loss sums its
    # per-expert token counts over them.
    TP_DP_CP = "tp_dp_cp"
    # The distributed optimizer in several instances (megatron-core's partial distributed optimizer,
    # ParallelPlan.distributed_optimizer_instances): DP (or expert DP) split into consecutive
    # intra-instance groups that shard the optimizer, and the inter-instance groups of the ranks
    # holding the same shard (stride: the intra size).
    DP_INTRA = "dp_intra"
    DP_INTER = "dp_inter"
    EXPERT_DP_INTRA = "expert_dp_intra"
    EXPERT_DP_INTER = "expert_dp_inter"


# The groups of context-parallel attention's collectives.
CP_GROUPS = frozenset({ParallelGroup.CP, ParallelGroup.CP_A2A, ParallelGroup.CP_P2P})


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelKey:
    """Everything that determines a kernel's duration: the op, its tensor inputs and its arguments.

    ``input_shapes``/``dtypes`` list the tensor inputs in schema order (tensor lists flattened);
    ``args`` holds every non-tensor argument by schema name (a tensor list's entry is its length),
    so the call can be rebuilt for replay from the op's schema alone.
    """

    op: str  # e.g. "aten.mm.default"
    input_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    args: tuple[tuple[str, Scalar | tuple], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "input_shapes": [list(s) for s in self.input_shapes],
            "dtypes": list(self.dtypes),
            "args": [[k, _jsonable(a)] for k, a in self.args],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelKey:
        return cls(
            op=d["op"],
            input_shapes=tuple(map(tuple, d["input_shapes"])),
            dtypes=tuple(d["dtypes"]),
            args=tuple((k, _tupled(a)) for k, a in d["args"]),
        )

    @property
    def digest(self) -> str:
        """Stable 20-hex-digit id of this key (canonical JSON, SHA-1)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(text.encode()).hexdigest()[:20]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpNode:
    key: KernelKey
    phase: Phase
    module: str  # e.g. "decoder.layers.0.mlp.linear_fc1" (layer index as in the template)
    output_shapes: tuple[tuple[int, ...], ...] = ()
    launches_kernel: bool = True  # False for views, detach, metadata and other no-kernel ops
    flops: int = 0
    nbytes: int = 0  # bytes read plus bytes written by the kernel

    @property
    def op(self) -> str:
        return self.key.op

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "op",
            "key": self.key.to_dict(),
            "phase": self.phase.value,
            "module": self.module,
            "output_shapes": [list(s) for s in self.output_shapes],
            "launches_kernel": self.launches_kernel,
            "flops": self.flops,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpNode:
        return cls(
            key=KernelKey.from_dict(d["key"]),
            phase=member(Phase, d["phase"]),
            module=d["module"],
            output_shapes=tuple(map(tuple, d["output_shapes"])),
            launches_kernel=d["launches_kernel"],
            flops=d["flops"],
            nbytes=d["nbytes"],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveNode:
    kind: CollectiveKind
    nbytes: int  # bytes of the tensor this rank contributes/receives (NCCL's "size")
    group: ParallelGroup
    group_size: int
    phase: Phase
    module: str
    dtype: str = "float16"
    synthesized: bool = False  # True when derived from traced tensors rather than seen as a c10d call

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "collective",
            "kind": self.kind.value,
            "nbytes": self.nbytes,
            "group": self.group.value,
            "group_size": self.group_size,
            "phase": self.phase.value,
            "module": self.module,
            "dtype": self.dtype,
            "synthesized": self.synthesized,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CollectiveNode:
        return cls(
            kind=member(CollectiveKind, d["kind"]),
            nbytes=d["nbytes"],
            group=member(ParallelGroup, d["group"]),
            group_size=d["group_size"],
            phase=member(Phase, d["phase"]),
            module=d["module"],
            dtype=d["dtype"],
            synthesized=d["synthesized"],
        )


Node = Union[OpNode, CollectiveNode]


_MEMBERS = {enum: {member.value: member for member in enum} for enum in (Phase, CollectiveKind, ParallelGroup)}


def member(enum: type[StrEnum], value: str) -> Any:
    """``enum(value)`` by one dict look-up (a stored graph holds thousands; the enum call is ten times
    slower); an unknown value is the same ValueError."""
    try:
        return _MEMBERS[enum][value]
    except KeyError:
        return enum(value)


def _node_from_dict(d: dict[str, Any]) -> Node:
    return OpNode.from_dict(d) if d["type"] == "op" else CollectiveNode.from_dict(d)


class BlockKind(StrEnum):
    EMBEDDING = "embedding"  # word/position embeddings (first stage)
    LAYER = "layer"  # one transformer layer, repeated ``count`` times
    HEAD = "head"  # final norm, output layer and loss (last stage)
    STAGE = "stage"  # whatever else a stage runs once (e.g. a plain nn.Module)


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    kind: BlockKind
    name: str  # module prefix, e.g. "embedding", "decoder.layers.0", "output_layer"
    count: int = 1
    nodes: tuple[Node, ...] = ()
    activation_nbytes: int = 0  # per instance and micro-batch: tensors forward keeps for backward
    # activation_nbytes by the module that saved each tensor (module path, bytes), in the order of the
    # trace: what a software stack's own modules keep is known module by module (cost/stack_memory.py).
    saved_by_module: tuple[tuple[str, int], ...] = ()
    num_parameters: int = 0  # per instance, on this rank
    # Elements of each parameter of one instance, in the model's parameter order (what Megatron's
    # gradient buffers are laid out from); empty when not known (then one tensor of num_parameters).
    # MoE experts split by expert parallelism are counted apart, in expert_parameter_numels.
    parameter_numels: tuple[int, ...] = ()
    # Elements of each parameter Megatron's DDP reduces over expert DP rather than DP (the weights of
    # experts split by expert parallelism), in parameter order; part of num_parameters.
    expert_parameter_numels: tuple[int, ...] = ()

    @property
    def num_expert_parameters(self) -> int:
        return sum(self.expert_parameter_numels)

    @property
    def parameter_sizes(self) -> tuple[int, ...]:
        """``parameter_numels``, or the non-expert parameters as one tensor when they are not known."""
        if self.parameter_numels:
            return self.parameter_numels
        dense = self.num_parameters - self.num_expert_parameters
        return (dense,) if dense else ()

    def ops(self, phase: Phase | None = None, *, kernels_only: bool = True) -> Iterator[OpNode]:
        for n in self.nodes:
            if isinstance(n, OpNode) and (not kernels_only or n.launches_kernel) and (
                phase is None or n.phase is phase
            ):
                yield n

    def collectives(self, phase: Phase | None = None) -> Iterator[CollectiveNode]:
        for n in self.nodes:
            if isinstance(n, CollectiveNode) and (phase is None or n.phase is phase):
                yield n

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "name": self.name, "count": self.count,
                "activation_nbytes": self.activation_nbytes, "num_parameters": self.num_parameters,
                "saved_by_module": [list(pair) for pair in self.saved_by_module],
                "parameter_numels": list(self.parameter_numels),
                "expert_parameter_numels": list(self.expert_parameter_numels),
                "nodes": [n.to_dict() for n in self.nodes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Block:
        return cls(kind=BlockKind(d["kind"]), name=d["name"], count=d["count"],
                   activation_nbytes=d["activation_nbytes"], num_parameters=d["num_parameters"],
                   saved_by_module=tuple((str(m), int(n)) for m, n in d["saved_by_module"]),
                   parameter_numels=tuple(d["parameter_numels"]),
                   expert_parameter_numels=tuple(d["expert_parameter_numels"]),
                   nodes=tuple(_node_from_dict(n) for n in d["nodes"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class StageGraph:
    """One model chunk on one representative rank: pipeline rank ``pipeline_rank``, chunk ``chunk``."""

    pipeline_rank: int
    chunk: int = 0
    blocks: tuple[Block, ...] = ()
    activation_shape: tuple[int, ...] = ()  # tensor sent to the next stage per micro-batch
    activation_dtype: str = "float16"
    # Elements of the word embedding (first stage) or output weight (last stage) held here: the
    # tensor whose gradient Megatron all-reduces between the two when they are tied.
    word_embedding_parameters: int = 0
    # Bytes one micro-batch's step holds beside its saved activations when its backward begins
    # (megatron-core's global buffer of attention scores, what the step still references), and the
    # most its backward (recompute included) then rises above that level: one recomputed layer's
    # activations and the gradients in flight, less what it freed before
    # (vtrain_plugin.capture.live_memory). 0: not measured (a plain module).
    held_nbytes: int = 0
    backward_peak_nbytes: int = 0
    # The same without the storages that ops of a core attention create (its global score buffer,
    # score-sized tensors and gradients): what a stack with a fused attention kernel holds
    held_outside_attention_nbytes: int = 0
    backward_peak_outside_attention_nbytes: int = 0
    # backward_peak_nbytes with the temporary torch's softmax backward makes on a GPU (its kernel
    # computes grad * output apart; the CPU's and the fused softmax kernels do not): what the local
    # spec's step holds on a GPU
    gpu_softmax_backward_peak_nbytes: int = 0

    @property
    def num_parameters(self) -> int:
        """Parameters held by this rank for this chunk."""
        return sum(b.count * b.num_parameters for b in self.blocks)

    @property
    def num_expert_parameters(self) -> int:
        """Of :attr:`num_parameters`, those reduced over expert DP (experts split by expert parallelism)."""
        return sum(b.count * b.num_expert_parameters for b in self.blocks)

    @property
    def num_layers(self) -> int:
        return sum(b.count for b in self.blocks if b.kind is BlockKind.LAYER)

    @property
    def has_embedding(self) -> bool:
        return any(b.kind is BlockKind.EMBEDDING for b in self.blocks)

    @property
    def has_head(self) -> bool:
        return any(b.kind is BlockKind.HEAD for b in self.blocks)

    @property
    def activation_nbytes(self) -> int:
        """Activation memory one micro-batch leaves on this rank until its backward."""
        return sum(b.count * b.activation_nbytes for b in self.blocks)

    def layer_template(self) -> Block | None:
        return next((b for b in self.blocks if b.kind is BlockKind.LAYER), None)

    def flops(self, phase: Phase | None = None) -> int:
        return sum(b.count * op.flops for b in self.blocks for op in b.ops(phase))

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline_rank": self.pipeline_rank,
            "chunk": self.chunk,
            "activation_shape": list(self.activation_shape),
            "activation_dtype": self.activation_dtype,
            "word_embedding_parameters": self.word_embedding_parameters,
            "held_nbytes": self.held_nbytes,
            "backward_peak_nbytes": self.backward_peak_nbytes,
            "held_outside_attention_nbytes": self.held_outside_attention_nbytes,
            "backward_peak_outside_attention_nbytes": self.backward_peak_outside_attention_nbytes,
            "gpu_softmax_backward_peak_nbytes": self.gpu_softmax_backward_peak_nbytes,
            "blocks": [b.to_dict() for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageGraph:
        return cls(
            pipeline_rank=d["pipeline_rank"],
            chunk=d["chunk"],
            activation_shape=tuple(d["activation_shape"]),
            activation_dtype=d["activation_dtype"],
            word_embedding_parameters=d["word_embedding_parameters"],
            held_nbytes=d["held_nbytes"],
            backward_peak_nbytes=d["backward_peak_nbytes"],
            held_outside_attention_nbytes=d["held_outside_attention_nbytes"],
            backward_peak_outside_attention_nbytes=d["backward_peak_outside_attention_nbytes"],
            gpu_softmax_backward_peak_nbytes=d.get("gpu_softmax_backward_peak_nbytes", d["backward_peak_nbytes"]),
            blocks=tuple(Block.from_dict(b) for b in d["blocks"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class OpGraph:
    """The traced iteration of one representative rank per model chunk.

    ``model`` is the traced model's spec (None for a plain ``nn.Module``, then ``module_name`` names
    it) and ``parallel`` the plan it was traced under. Reading and writing graph files lives in
    :mod:`vtrain_plugin.capture.graph_file`, the layer that knows the specs.
    """

    model: ModelSpec | None
    parallel: ParallelPlan
    micro_batch_size: int
    seq_length: int
    stages: tuple[StageGraph, ...]
    module_name: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def name(self) -> str:
        """What the table headers call the model: its name, else its family or module class."""
        if self.model is None:
            return self.module_name or "module"
        return self.model.name or self.model.family.value

    @property
    def dtype(self) -> Dtype:
        """The model's dtype (a plain module is taken to train in fp32)."""
        return Dtype.FP32 if self.model is None else self.model.dtype

    def stage(self, pipeline_rank: int, chunk: int = 0) -> StageGraph:
        for s in self.stages:
            if s.pipeline_rank == pipeline_rank and s.chunk == chunk:
                return s
        raise KeyError(f"no stage with pipeline_rank={pipeline_rank} chunk={chunk}")

    def flops(self, phase: Phase | None = None) -> int:
        """FLOPs of one micro-batch through every chunk (one rank's share of each, so times TP)."""
        return sum(s.flops(phase) for s in self.stages)

    def unique_kernels(self) -> dict[KernelKey, UniqueKernel]:
        """Every distinct kernel key with how often one micro-batch (and one optimizer step) runs it."""
        counts: Counter[KernelKey] = Counter()
        example: dict[KernelKey, OpNode] = {}
        for s in self.stages:
            for b in s.blocks:
                for op in b.ops():
                    counts[op.key] += b.count
                    example.setdefault(op.key, op)
        return {k: UniqueKernel(key=k, count=c, flops=example[k].flops, nbytes=example[k].nbytes)
                for k, c in counts.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": None if self.model is None else self.model.to_dict(),
            "module_name": self.module_name,
            "parallel": self.parallel.to_dict(),
            "micro_batch_size": self.micro_batch_size,
            "seq_length": self.seq_length,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class UniqueKernel:
    key: KernelKey
    count: int
    flops: int
    nbytes: int


def _jsonable(a: Any) -> Any:
    return [_jsonable(x) for x in a] if isinstance(a, tuple) else a


def _tupled(a: Any) -> Any:
    return tuple(_tupled(x) for x in a) if isinstance(a, list) else a
