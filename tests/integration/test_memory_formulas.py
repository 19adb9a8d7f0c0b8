"""Memory per GPU against the published closed formulas, on real traced models.

References, re-derived here (not imported):

* Megatron-LM, ``megatron/training/theoretical_memory_usage.py``:
  ``compute_weight_and_optimizer_memory`` (parameters of the most loaded shard, the first pipeline
  stage, times 18 bytes, or ``6 + 12 / DP`` with the distributed optimizer) and
  ``compute_activation_memory`` (first stage, for sequence parallelism with selective recompute:
  ``s b h (18 + 4 ffn / h)`` per layer over all ``L`` layers, ``8 s b pp`` for the embedding's input
  and ``s b h pp`` for its dropout mask, times ``min(1, m / pp)`` for 1F1B or the interleaved
  penalty ``1 + (pp - 1) / (pp v)``, plus ``4 s b h (1 + V / h)`` for the output layer and the loss
  when ``pp == 1``; everything divided by ``t``).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2:
  bytes per layer ``s b h (10 + 24 / t + 5 a s / (h t))`` with TP, ``s b h (34 / t + 5 a s / (h t))``
  with TP and SP, without the ``5 a s`` term under selective recompute, ``2 s b h`` (``/ t`` with
  SP) under full recompute.

Where vtrain differs it is by design: it counts what the traced model (megatron-core's local spec)
saves, and where that differs from the formulas the difference is written out below and checked
to the byte:

* parameters: the formula counts no linear biases and no learned position embedding, divides
  every parameter by ``t`` and gives each layer ``4 h`` of norm weights; the traced shards keep the
  row-parallel biases and the norms whole on every TP rank, and RMSNorm has ``h`` weights per norm;
* activations: the local spec as traced on the CPU keeps its dropout masks in the model dtype (2
  bytes, not the paper's 1; an estimate counts them as a GPU keeps them, 1 byte), the attention softmax in fp32 (4 bytes, not 2), the LayerNorm statistics (mean and rstd of
  each token, in the model dtype on the traced CPU), and the checkpointed core attention one int32
  scalar; the embedding keeps its token ids (not divided by ``t``), position ids and, with TP, a
  1-byte mask of out-of-shard ids; the loss its labels and target mask; and every chunk the 1-byte
  ``s x s`` attention mask once per micro-batch, which the formula (written for fused causal
  attention) has not;
* in flight: vtrain walks the schedule per chunk; Megatron scales the embedding by the interleaved
  penalty too, where the first chunk of the first rank holds more micro-batches at the peak.

The Megatron activation formula assumes a GeLU MLP and multi-head attention (its source says so),
so Llama plans are compared on weights and optimizer state only.
"""

import pytest

from vtrain_plugin.capture.tracer import trace
from vtrain_plugin.estimate import estimate
from vtrain_plugin.hardware.clusters import get_cluster_preset
from vtrain_plugin.specs.model import ModelSpec
from vtrain_plugin.specs.parallel import ParallelPlan
from vtrain_plugin.specs.training import TrainingSpec

GIB = 2**30
S, B, H, A, L, VOCAB = 128, 2, 256, 8, 8, 1000
GPT = ModelSpec(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=VOCAB, dtype="bf16")
LLAMA = ModelSpec(family="llama", num_layers=4, hidden_size=H, num_attention_heads=A, num_query_groups=2,
                  seq_length=S, vocab_size=VOCAB, dtype="bf16")
CLUSTER = get_cluster_preset("dgx-h100")


# -- Megatron-LM's theoretical_memory_usage, re-derived ------------------------------------------

def megatron_parameters_on_first_shard(model: ModelSpec, plan: ParallelPlan) -> float:
    """compute_weight_and_optimizer_memory's num_parameters_on_most_loaded_model_shard."""
    h, layers, heads, groups = model.hidden_size, model.num_layers, model.num_attention_heads, model.query_groups
    query_projection = model.head_dim * heads
    gated = 3 / 2 if model.family.value == "llama" else 1
    in_layers = 2 * layers * h * h * ((1 + groups / heads) * query_projection / h + model.ffn_size / h * gated
                                      + 2 / h + 1 / (layers * h))
    embedding = h * model.padded_vocab_size(plan.tensor_parallel)
    shard = (in_layers / plan.pipeline_parallel + embedding) / plan.tensor_parallel
    if not model.tied and plan.pipeline_parallel == 1:
        shard += embedding / plan.tensor_parallel
    return shard


def megatron_bytes_per_parameter(plan: ParallelPlan, distributed_optimizer: bool) -> float:
    return 6 + 12 / plan.data_parallel if distributed_optimizer else 18


def megatron_activation_bytes(model: ModelSpec, plan: ParallelPlan, num_microbatches: int) -> float:
    """compute_activation_memory (sequence parallelism and selective recompute), first stage."""
    s, b, h, pp, t = model.seq_length, plan.micro_batch_size, model.hidden_size, plan.pipeline_parallel, \
        plan.tensor_parallel
    memory = s * b * h * (18 + 4 * model.ffn_size / h) * model.num_layers
    memory += 8 * s * b * pp + s * b * h * pp
    if plan.virtual_pipeline > 1:
        memory *= 1 + (pp - 1) / (pp * plan.virtual_pipeline)
    elif pp > 1:
        memory *= min(1, num_microbatches / pp)
    if pp == 1:
        memory += s * b * h * 4 * (1 + model.padded_vocab_size(t) / h)
    return memory / t


# -- what the traced local spec keeps beyond the formulas (see the module doc) ---------------------

def gpt_parameters(model: ModelSpec, plan: ParallelPlan, *, first: bool, last: bool, layers: int) -> int:
    """The traced shard: weights and column-parallel biases split over t, norms, row-parallel
    biases and the learned positions whole."""
    h, t, v = model.hidden_size, plan.tensor_parallel, model.padded_vocab_size(plan.tensor_parallel)
    layer = 12 * h * h // t + 7 * h // t + 2 * h + 4 * h
    out = layers * layer
    if first:
        out += v * h // t + model.seq_length * h
    if last:
        out += 2 * h + (v * h // t if plan.pipeline_parallel > 1 else 0)  # tied: a copy on the last stage
    return out


def llama_parameters(model: ModelSpec, plan: ParallelPlan, *, first: bool, last: bool, layers: int) -> int:
    h, t, f, v = model.hidden_size, plan.tensor_parallel, model.ffn_size, model.padded_vocab_size(plan.tensor_parallel)
    layer = (h + 2 * model.query_groups * model.head_dim) * h // t + h * h // t + 3 * h * f // t + 2 * h
    return layers * layer + (v * h // t if first else 0) + (h + v * h // t if last else 0)


def layer_extras(plan: ParallelPlan, s: int, b: int, h: int, a: int, statistic: int = 2, mask: int = 2) -> int:
    """Traced bytes of one GPT layer beyond Korthikanti's Table 2 (2-byte activations); norm
    statistics of ``statistic`` bytes (2 as torch's bf16 LayerNorm keeps them; TE's fused LayerNorm
    keeps them in fp32, :data:`TE_STATISTIC`), dropout masks of ``mask`` bytes per element (2 as
    traced on the CPU, 1 as an estimate for a GPU keeps them, :data:`GPU_MASK`)."""
    t = plan.tensor_parallel
    split = t if plan.sequence_parallel else 1  # what sequence parallelism divides
    if plan.recompute.value == "full":
        return 0
    masks = 2 * s * b * h // split * (mask - 1)  # two hidden dropout masks, the paper's at 1 byte
    statistics = 2 * 2 * (s // split) * b * statistic  # two norms' mean and rstd per token
    if plan.recompute.value == "selective":
        return masks + statistics + 4  # the int32 scalar the checkpointed attention keeps
    return masks + statistics + 3 * a * s * s * b // t  # fp32 softmax (+2), 2-byte dropout mask (+1)


def korthikanti_layer(plan: ParallelPlan, s: int, b: int, h: int, a: int) -> float:
    t = plan.tensor_parallel
    attention = 5 * a * s / (h * t)
    if plan.recompute.value == "full":
        return 2 * s * b * h / (t if plan.sequence_parallel else 1)
    if plan.recompute.value == "selective":
        attention = 0
    if plan.sequence_parallel:
        return s * b * h * (34 / t + attention)
    return s * b * h * (10 + 24 / t + attention)


def embedding_extras(plan: ParallelPlan, s: int, b: int, h: int, mask: int = 2) -> float:
    """Embedding bytes (dropout mask of ``mask`` bytes per element) minus Megatron's (8 s b + s b h) / t."""
    t = plan.tensor_parallel
    traced = 8 * s * b + (s * b if t > 1 else 0) + 8 * s + mask * s * b * h // t
    return traced - (8 * s * b + s * b * h) / t


def chunk_extras(s: int, b: int, *, last: bool) -> int:
    """The attention mask, and on the last stage the fp32 loss mask and a scalar."""
    return s * s + (4 * s * b + 4 if last else 0)


def head_extras(plan: ParallelPlan, s: int, b: int, statistic: int = 2) -> float:
    """Traced head bytes minus Megatron's 4 s b h (1 + V / h) / t: final-norm statistics, the
    target mask and the int64 labels."""
    return 2 * statistic * (s // plan.tensor_parallel) * b + s * b + 8 * s * b


TE_STATISTIC = 4  # the estimates run bf16 on TransformerEngine: fp32 norm statistics (cost/te_saved.py)
GPU_MASK = 1  # and keep dropout masks as a GPU does, a byte per element (cost/lowering/dropout_masks.py)


# -- the plans --------------------------------------------------------------------------------------

def first_stage(model, plan, training):
    est = estimate(trace(model, plan), cluster=CLUSTER, training=training)
    return est.memory_gib[0], est.num_microbatches


def fused_attention_step(model, plan) -> int:
    """What the first stage's traced step holds beside its activations and what its backward adds,
    outside the core attention (the TE stack's, tests/integration/test_backward_peak_memory.py)."""
    stage = trace(model, plan).stage(0)
    return stage.held_outside_attention_nbytes + stage.backward_peak_outside_attention_nbytes


SP_SELECTIVE = [
    pytest.param(ParallelPlan(tensor_parallel=2, data_parallel=2, sequence_parallel=True, micro_batch_size=B,
                              recompute="selective"), 2, False, id="tp2 sp pp1 dp2"),
    pytest.param(ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=4, sequence_parallel=True,
                              micro_batch_size=B, recompute="selective"), 8, True, id="tp2 sp pp2 dp4 distopt"),
    pytest.param(ParallelPlan(tensor_parallel=2, pipeline_parallel=4, data_parallel=2, sequence_parallel=True,
                              micro_batch_size=B, recompute="selective"), 2, True, id="tp2 sp pp4 m<pp distopt"),
]


@pytest.mark.parametrize("plan,num_microbatches,zero", SP_SELECTIVE)
def test_gpt_first_stage_is_megatrons_theoretical_memory_plus_the_traced_extras(plan, num_microbatches, zero):
    training = TrainingSpec(global_batch_size=num_microbatches * plan.data_parallel * B, distributed_optimizer=zero)
    memory, m = first_stage(GPT, plan, training)
    pp, t = plan.pipeline_parallel, plan.tensor_parallel
    layers = L // pp
    # weights and optimizer: Megatron's bytes per parameter exactly, on the traced parameters
    params = gpt_parameters(GPT, plan, first=True, last=pp == 1, layers=layers)
    per_parameter = megatron_bytes_per_parameter(plan, zero)
    states = (memory.weights_gib + memory.gradients_gib + memory.optimizer_gib) * GIB
    assert states == pytest.approx(params * per_parameter, rel=1e-12)
    # Megatron: no biases (7 h / t column- and 2 h row-parallel per layer) nor positions (s h), and
    # the 4 h of norm weights per layer and the 2 h of the final norm (a pp-th of it) divided by t
    biases = layers * (7 * H // t + 2 * H) + S * H
    norms = layers * 4 * H - layers * 4 * H / t + (2 * H if pp == 1 else 0) - 2 * H / (pp * t)
    assert params - megatron_parameters_on_first_shard(GPT, plan) == pytest.approx(biases + norms, rel=1e-12)
    # activations: Megatron's formula plus, per micro-batch in flight, the extras
    inflight = min(pp, m)
    assert memory.inflight_microbatches == inflight
    extras = inflight * (layers * layer_extras(plan, S, B, H, A, TE_STATISTIC, GPU_MASK)
                         + embedding_extras(plan, S, B, H, GPU_MASK)
                         + chunk_extras(S, B, last=pp == 1))
    if pp == 1:
        extras += head_extras(plan, S, B, TE_STATISTIC)
    extras += fused_attention_step(GPT, plan)
    assert memory.activations_gib * GIB == pytest.approx(megatron_activation_bytes(GPT, plan, m) + extras, rel=1e-12)


def test_gpt_interleaved_holds_megatrons_in_flight_layers():
    """PP 2 x VP 2 with 4 micro-batches: the first rank holds pp v + pp - 1 = 5 chunk
    micro-batches at its peak, Megatron's interleaved penalty (1 + (pp - 1) / (pp v)) x pp v."""
    pp, v = 2, 2
    plan = ParallelPlan(tensor_parallel=2, pipeline_parallel=pp, virtual_pipeline=v, data_parallel=2,
                        sequence_parallel=True, micro_batch_size=B, recompute="selective")
    training = TrainingSpec(global_batch_size=4 * 2 * B, schedule="interleaved_1f1b", distributed_optimizer=True)
    memory, m = first_stage(GPT, plan, training)
    assert memory.inflight_microbatches == (1 + (pp - 1) / (pp * v)) * pp * v == 5
    per_chunk = (L // (pp * v) * (korthikanti_layer(plan, S, B, H, A) + layer_extras(plan, S, B, H, A, TE_STATISTIC, GPU_MASK))
                 + S * S)
    embedding = 8 * S * B + S * B + 8 * S + S * B * H // plan.tensor_parallel  # tokens, mask, positions, dropout
    # the peak (right after the fourth chunk-0 forward) holds 4 chunk-0 and 1 chunk-1 micro-batches
    step = fused_attention_step(GPT, plan)
    assert memory.activations_gib * GIB == 5 * per_chunk + 4 * embedding + step
    # Megatron scales the embedding by the same penalty (pp x 1.25 = 2.5 micro-batches' worth); the
    # first chunk of the first rank holds 4 micro-batches at that peak, which the walk counts
    megatron_embedding = (8 * S * B + S * B * H) / plan.tensor_parallel
    explained = (5 * (L // (pp * v) * layer_extras(plan, S, B, H, A, TE_STATISTIC, GPU_MASK) + S * S) + 4 * embedding
                 - 2.5 * megatron_embedding + step)
    assert memory.activations_gib * GIB == pytest.approx(megatron_activation_bytes(GPT, plan, m) + explained, rel=1e-12)


@pytest.mark.parametrize("tp,sp,recompute", [
    (1, False, "none"), (2, False, "none"), (2, True, "none"), (1, False, "selective"), (2, False, "selective"),
    (2, True, "selective"), (2, False, "full"), (2, True, "full"),
])
def test_traced_layer_is_korthikantis_table_2_plus_the_local_specs_extras(tp, sp, recompute):
    plan = ParallelPlan(tensor_parallel=tp, pipeline_parallel=2, sequence_parallel=sp, micro_batch_size=B,
                        recompute=recompute)
    layer = trace(GPT, plan).stage(0).layer_template()
    assert layer.activation_nbytes == korthikanti_layer(plan, S, B, H, A) + layer_extras(plan, S, B, H, A)


LLAMA_PLANS = [
    pytest.param(ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel=4, micro_batch_size=1), True,
                 id="llama tp2 pp2 dp4 distopt"),
    pytest.param(ParallelPlan(data_parallel=2, micro_batch_size=1), False, id="llama pp1 untied"),
]


@pytest.mark.parametrize("plan,zero", LLAMA_PLANS)
def test_llama_weights_and_optimizer_are_megatrons_bytes_per_parameter(plan, zero):
    training = TrainingSpec(global_batch_size=4 * plan.data_parallel, distributed_optimizer=zero)
    memory, _ = first_stage(LLAMA, plan, training)
    pp, t = plan.pipeline_parallel, plan.tensor_parallel
    layers = LLAMA.num_layers // pp
    params = llama_parameters(LLAMA, plan, first=True, last=pp == 1, layers=layers)
    states = (memory.weights_gib + memory.gradients_gib + memory.optimizer_gib) * GIB
    assert states == pytest.approx(params * megatron_bytes_per_parameter(plan, zero), rel=1e-12)
    # Megatron counts 4 h of norm weights per layer and 2 h for the final norm, all divided by t;
    # RMSNorm has h per norm, kept whole on every TP rank
    norms_formula = (layers * 4 * H + 2 * H / pp) / t
    norms_traced = layers * 2 * H + (H if pp == 1 else 0)
    assert params - megatron_parameters_on_first_shard(LLAMA, plan) == pytest.approx(norms_traced - norms_formula,
                                                                                     rel=1e-12)
