"""How each Megatron-LM flag that shapes the plan maps onto vtrain's specs, and the one-line errors."""

import re
from pathlib import Path

import pytest

from tests.conftest import REPO
from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.launch_script import read_command_line
from vtrain_plugin.specs.megatron.args import FIELDS, MegatronPlan, megatron_plan, parse_flags
from vtrain_plugin.specs.megatron.flags import MEGATRON_FLAGS, PERFORMANCE_FLAGS, RETIRED_FLAGS, UNSUPPORTED_FLAGS, Arity
from vtrain_plugin.specs.model import Family
from vtrain_plugin.specs.parallel import FlexBackend, Recompute, TokenDispatcher
from vtrain_plugin.specs.training import Fp8Format, Fp8Recipe, GradReduce, ScheduleKind, SoftwareStack

BASE = "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 256 --micro-batch-size 2 --vocab-size 1000"


def plan(flags: str = "", gpus: int | None = 8) -> MegatronPlan:
    return megatron_plan(read_command_line(f"{BASE} {flags}"), gpus=gpus)


def error(flags: str = "", gpus: int | None = 8) -> str:
    with pytest.raises(ConfigError) as exc:
        plan(flags, gpus)
    return str(exc.value)


def test_every_flag_the_mapping_reads_is_a_megatron_flag():
    reader = REPO / "vtrain_plugin" / "specs" / "megatron"
    read = {flag for name in ("args.py", "model.py")
            for flag in re.findall(r'"(--[a-z0-9-]+)"', (reader / name).read_text())}
    mapped = read | {row.flag for row in FIELDS} | PERFORMANCE_FLAGS | set(RETIRED_FLAGS) | set(UNSUPPORTED_FLAGS)
    assert sorted(mapped - set(MEGATRON_FLAGS)) == []
    assert MEGATRON_FLAGS["--rampup-batch-size"] is Arity.LIST and MEGATRON_FLAGS["--fp16"] is Arity.SWITCH


def test_defaults_are_megatrons():
    p = plan()
    assert p.model.family is Family.GPT and p.model.dtype is Dtype.FP32 and p.model.tied
    assert p.model.ffn_hidden_size == 4 * 512 and p.model.num_query_groups is None
    assert (p.parallel.tensor_parallel, p.parallel.pipeline_parallel, p.parallel.data_parallel) == (1, 1, 8)
    assert p.training.global_batch_size == 2 * 8  # micro-batch x data parallel
    assert p.parallel.recompute is Recompute.NONE and p.training.grad_reduce is GradReduce.AFTER_BACKWARD
    assert p.unmodelled == ()


def test_fp8_flags_set_the_training_precision():
    p = plan("--bf16 --fp8-format hybrid --fp8-recipe tensorwise")
    assert (p.training.fp8, p.training.fp8_recipe) == (Fp8Format.HYBRID, Fp8Recipe.TENSORWISE)
    assert plan("--bf16 --fp8-format e4m3").training.fp8_recipe is Fp8Recipe.DELAYED  # Megatron-LM's default
    assert plan("--bf16").training.fp8 is None


def test_swiglu_makes_a_llama_layer_with_megatrons_ffn_size():
    p = plan("--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
             "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --hidden-size 4096 "
             "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --bf16")
    assert p.model.family is Family.LLAMA and not p.model.tied and p.model.num_query_groups == 8
    assert p.model.ffn_hidden_size == 10880  # int(4 x 4096 x 2/3 / 64) x 64, not vtrain's own 11008
    assert p.unmodelled == ()


def test_layer_features_other_than_the_familys_are_modelled_not_noted():
    p = plan("--swiglu --position-embedding-type learned_absolute --num-query-groups 2 --bf16 --grad-reduce-in-bf16")
    assert p.model.family is Family.LLAMA and p.model.num_query_groups is None
    assert (p.model.normalization, p.model.position_embedding_type, p.model.add_bias_linear,
            p.model.hidden_dropout, p.model.attention_dropout) == ("LayerNorm", "learned_absolute", True, 0.1, 0.1)
    assert p.unmodelled == ("--num-query-groups 2 without --group-query-attention (Megatron-LM ignores it)",)
    assert p.training.grad_reduce_in_bf16  # mapped (training.grad_reduce_in_bf16), not noted
    assert plan("--bf16").unmodelled == ()


@pytest.mark.parametrize("flags, message", [
    ("--squared-relu --swiglu", "--squared-relu and --swiglu exclude each other (Megatron-LM asserts it)"),
    ("--position-embedding-type yarn", "--position-embedding-type yarn: YaRN rotary embeddings is not modelled by "
                                       "vtrain yet"),
    ("--position-embedding-type rope --kv-channels 3", "model: the head dim (kv_channels) = 3 must be even and positive: rotary position "
                                                       "embeddings rotate pairs of channels"),
    ("--context-parallel-size 2 --cp-comm-type p2p a2a", "--cp-comm-type p2p a2a: one type for every layer is "
                                                         "modelled"),
    ("--context-parallel-size 2 --cp-comm-type ring", "parallel.cp_comm_type must be one of p2p, all_gather, "
                                                      "a2a, a2a+p2p; got 'ring'"),
    ("--num-experts 8 --moe-layer-freq '([0]*3+[1]*2)'",
     "model.moe_layer_freq: a per-layer pattern needs model.num_layers (8) entries, each 0 (dense) or 1 (MoE); got 5"),
    ("--num-experts 8 --moe-layer-freq \"open('x')\"", "--moe-layer-freq open('x'): must be an integer or a Python list "
                                                   "such as ([0]*3+[1]*58) (lists of integers, + and * only)"),
    ("--num-experts 8 --moe-pad-expert-input-to-capacity", "model.moe_pad_expert_input_to_capacity needs "
                                                           "model.moe_expert_capacity_factor (the capacity to pad to)"),
    ("--num-experts 8 --moe-router-enable-expert-bias", "model.moe_router_enable_expert_bias needs "
                                                        "model.moe_router_score_function sigmoid (megatron-core's "
                                                        "aux-loss-free routing)"),
    ("--num-experts 8 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep",
     "parallel.moe_flex_dispatcher_backend must be one of deepep, hybridep; got 'ncclep'"),
    ("--num-experts 8 --moe-enable-deepep", "--moe-enable-deepep requires --moe-token-dispatcher-type flex "
                                            "(megatron-core's rule)"),
    ("--num-experts 8 --expert-model-parallel-size 2 --delay-wgrad-compute",
     "parallel.delay_wgrad_compute requires parallel.overlap_moe_expert_parallel_comm (megatron-core's rule)"),
    ("--num-experts 8 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
     "--overlap-moe-expert-parallel-comm --pipeline-model-parallel-size 2",
     "parallel.overlap_moe_expert_parallel_comm with pipeline_parallel (2) > 1 requires virtual_pipeline > 1 "
     "(megatron-core overlaps the all-to-alls in the interleaved schedule only)"),
    ("--num-experts 8 --expert-model-parallel-size 2 --overlap-moe-expert-parallel-comm",
     "parallel.overlap_moe_expert_parallel_comm requires moe_token_dispatcher alltoall or flex (got allgather)"),
    ("--num-experts 8 --moe-token-dispatcher-type ring", "parallel.moe_token_dispatcher must be one of alltoall, "
                                                         "allgather, flex; got 'ring'"),
    ("--moe-router-topk 2", "model.moe_router_topk needs model.num_experts (a mixture-of-experts model)"),
    ("--fp8-format e4m3 --fp8-recipe custom", "training.fp8_recipe must be one of delayed, tensorwise, mxfp8, "
                                              "blockwise; got 'custom'"),
    ("--overlap-param-gather", "training.overlap_param_gather requires training.distributed_optimizer: true"),
    ("--optimizer lion", "--optimizer lion: only adam, sgd, muon and dist_muon are modelled by vtrain"),
    ("--use-precision-aware-optimizer", "training.optimizer.precision_aware requires training.distributed_optimizer: "
                                        "true (megatron-core's OptimizerConfig asserts it)"),
    ("--optimizer sgd --use-precision-aware-optimizer --use-distributed-optimizer",
     "training.optimizer.precision_aware requires kind adam (got sgd): only TransformerEngine's FusedAdam keeps "
     "state in other dtypes"),
    ("--decoder-first-pipeline-num-layers 2", "parallel.decoder_first_pipeline_num_layers requires "
                                              "pipeline_parallel > 1 (got 1)"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 "
     "--num-layers-per-virtual-pipeline-stage 1", "--num-layers-per-virtual-pipeline-stage with "
                                                  "--decoder-first-pipeline-num-layers: give the virtual stages as "
                                                  "--num-virtual-stages-per-pipeline-rank"),
    ("--fp16 --bf16", "--fp16 and --bf16 exclude each other"),
    ("--batch-size 4", "--batch-size is retired in Megatron-LM; use --micro-batch-size"),
    ("--num-layers x", "--num-layers must be a positive integer, got 'x'"),
    ("--no-position-embedding", "--no-position-embedding is deprecated in Megatron-LM; use --position-embedding-type"),
    ("--max-position-embeddings 128", "--max-position-embeddings (128) must be at least --seq-length (256)"),
])
def test_refusals_are_one_line(flags, message):
    assert error(flags) == message


def test_deterministic_unfused_attention_optimizers_and_rank_order_set_their_fields():
    p = plan("--bf16 --deterministic-mode --attention-backend unfused --use-tp-pp-dp-mapping --use-distributed-optimizer "
             "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype fp8 --main-grads-dtype bf16")
    assert p.training.deterministic and p.training.unfused_attention and p.parallel.tp_pp_dp_mapping
    assert (p.training.optimizer.precision_aware, p.training.optimizer.exp_avg, p.training.optimizer.exp_avg_sq,
            p.training.optimizer.main_grads) == (True, "bf16", "fp8", "bf16")
    assert p.training.grad_dtype(Dtype.BF16) is Dtype.BF16  # bf16 main grads: the gradient buffer in bf16
    assert plan("--attention-backend local").training.unfused_attention
    assert not plan("--attention-backend flash").training.unfused_attention
    assert plan("--optimizer dist_muon --bf16").training.optimizer.kind == "muon"


def test_context_parallelism_and_tp_comm_overlap_set_their_fields():
    p = plan("--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 "
             "--cp-comm-type all_gather all_gather --tp-comm-overlap", gpus=16)
    assert (p.parallel.context_parallel, p.parallel.cp_comm_type.value, p.parallel.data_parallel) == (2, "all_gather", 4)
    assert p.training.tp_comm_overlap is True and p.warning is None
    assert plan("--context-parallel-size 4").parallel.cp_comm_type.value == "p2p"  # Megatron-LM's default


def test_flags_at_their_inactive_value_are_accepted():
    p = plan("--context-parallel-size 1 --expert-model-parallel-size 1 --optimizer adam --moe-layer-freq 1")
    assert p.parallel.data_parallel == 8


def test_moe_flags_set_the_experts_and_their_parallelism():
    p = plan("--num-experts 8 --moe-router-topk 1 --moe-ffn-hidden-size 256 --expert-model-parallel-size 4 "
             "--expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
             "--moe-aux-loss-coeff 1e-2")
    assert (p.model.num_experts, p.model.router_topk, p.model.expert_ffn_size) == (8, 1, 256)
    assert (p.parallel.expert_parallel, p.parallel.expert_tensor_parallel, p.parallel.moe_token_dispatcher) == (
        4, 1, TokenDispatcher.ALLTOALL)
    assert p.unmodelled == () and p.model.moe_grouped_gemm is True  # priced as grouped kernels
    defaults = plan("--num-experts 8")
    assert (defaults.model.router_topk, defaults.parallel.expert_parallel, defaults.parallel.expert_tp,
            defaults.parallel.moe_token_dispatcher) == (2, 1, 1, TokenDispatcher.ALLGATHER)  # Megatron-LM's
    assert plan().parallel.moe_token_dispatcher is TokenDispatcher.ALLTOALL  # a dense model: unused


def test_flex_dispatcher_and_ep_overlap_flags():
    moe = "--num-experts 8 --expert-model-parallel-size 4 --moe-token-dispatcher-type flex "
    p = plan(moe + "--moe-enable-deepep --moe-deepep-num-sms 24 --moe-hybridep-num-sms 8 "
                   "--overlap-moe-expert-parallel-comm --delay-wgrad-compute")
    assert (p.parallel.moe_token_dispatcher, p.parallel.moe_flex_dispatcher_backend, p.parallel.flex_num_sms,
            p.parallel.overlap_moe_expert_parallel_comm, p.parallel.delay_wgrad_compute) == (
        TokenDispatcher.FLEX, FlexBackend.DEEPEP, 24, True, True)  # the other backend's SMs change nothing
    hybrid = plan(moe + "--moe-flex-dispatcher-backend hybridep").parallel
    assert (hybrid.moe_flex_dispatcher_backend, hybrid.flex_num_sms) == (FlexBackend.HYBRIDEP, 16)  # megatron's default
    assert plan(moe + "--moe-flex-dispatcher-num-sms 32 --moe-deepep-num-sms 24").parallel.flex_num_sms == 32


@pytest.mark.parametrize("flags, message", [
    ("--num-layer 4", "unknown argument --num-layer: no Megatron-LM release from core_r0.8.0 to main has it (did "
                      "you mean --num-layers?)"),
    ("--my-own-flag=3", "unknown argument --my-own-flag: no Megatron-LM release from core_r0.8.0 to main has it"),
    ("--fp16 stray", "unexpected word 'stray': not the value of a Megatron-LM flag"),
    ("--lr", "Megatron-LM arguments: argument --lr: expected one argument"),
])
def test_words_that_are_not_megatron_arguments_are_refused(flags, message):
    assert error(flags) == message


def test_data_parallel_size_shows_its_arithmetic():
    assert plan("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2", gpus=64).parallel.data_parallel == 8
    assert error("--tensor-model-parallel-size 8", gpus=12) == (
        "GPUs (12) must be a multiple of --tensor-model-parallel-size (8) x --pipeline-model-parallel-size (1) x "
        "--context-parallel-size (1) = 8: data parallel size = 12 / 8 = 1.5")
    assert error(gpus=None) == ("the GPU count is unknown: give --gpus N (or torchrun --nnodes and "
                                "--nproc-per-node in the script)")


def test_torchrun_gives_the_gpu_count_and_gpus_overrides_it_with_a_note():
    command = read_command_line(f"torchrun --nnodes=2 --nproc-per-node 4 pretrain_gpt.py {BASE}")
    assert megatron_plan(command).parallel.data_parallel == 8
    assert megatron_plan(command, gpus=8).assumed == ()
    overridden = megatron_plan(command, gpus=512)
    assert overridden.parallel.data_parallel == 512
    assert overridden.assumed == ("--gpus 512 overrides the script's 2 nodes x 4 GPUs = 8",)
    assert overridden.note == "--gpus 512 overrides the script's 2 nodes x 4 GPUs = 8"
    elastic = read_command_line(f"torchrun --nnodes 1:4 --nproc_per_node 8 pretrain_gpt.py {BASE}")
    assert megatron_plan(elastic, gpus=24).assumed == ()  # inside the elastic range
    assert megatron_plan(elastic, gpus=12).assumed == ("--gpus 12 overrides the script's 1 to 4 nodes x 8 GPUs",)
    with pytest.raises(ConfigError, match=r"^the GPU count is unknown: torchrun --nnodes 1:4 x --nproc-per-node 8 is "
                                          r"a range of nodes; give --gpus N$"):
        megatron_plan(elastic)
    auto = read_command_line(f"python -m torch.distributed.run --nproc-per-node gpu pretrain_gpt.py {BASE}")
    with pytest.raises(ConfigError, match=r"--nproc-per-node gpu is not a product of whole numbers; give "
                                          r"--gpus N$"):
        megatron_plan(auto)
    assert megatron_plan(auto, gpus=4).parallel.data_parallel == 4
    assert megatron_plan(auto, gpus=4).assumed == ()


@pytest.mark.parametrize("flags, vocab_size, assumed", [
    ("--tokenizer-type GPT2BPETokenizer", 50257, ()),
    # megatron-core 0.16's NullTokenizer.vocab_size is the given size + 1 (its end-of-document id)
    ("--tokenizer-type NullTokenizer --vocab-size 128256", 128257, ()),
    ("--tokenizer-type HuggingFaceTokenizer --vocab-size 32000", 32000, ()),
    ("--vocab-size 50257 --make-vocab-size-divisible-by 64", 50304, ()),  # Megatron-LM's padding, a multiple of 128
    ("--vocab-size 50257 --make-vocab-size-divisible-by 256 --tensor-model-parallel-size 2", 50688, ()),
    ("--vocab-file $3 --merge-file $4", 50257,
     ("--vocab-file and --merge-file (no --tokenizer-type) taken as GPT-2's BPE files (50257 tokens; add "
      "--vocab-size N if not)",)),
    ("--tokenizer-type Llama2Tokenizer --tokenizer-model /data/tokenizer.model", 32000,
     ("--tokenizer-type Llama2Tokenizer taken as Llama-2's SentencePiece model (32000 tokens; add --vocab-size N if "
      "not)",)),
    ("--tokenizer-type Llama2Tokenizer --vocab-size 32768", 32768, ()),  # the flag wins over the assumption
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B", 128256,
     ("--tokenizer-model meta-llama/Meta-Llama-3-8B (128256 tokens; add --vocab-size N if not)",)),
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model /models/Llama-2-70b-hf/", 32000,
     ("--tokenizer-model /models/Llama-2-70b-hf/ taken as meta-llama/Llama-2-70b-hf (32000 tokens; add --vocab-size "
      "N if not)",)),
])
def test_vocabulary_sizes(flags, vocab_size, assumed):
    if "NullTokenizer" in flags:  # the rule is megatron-core's own
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
        assert NullTokenizer(128256).vocab_size == vocab_size
    base = BASE.replace(" --vocab-size 1000", "")
    p = megatron_plan(read_command_line(f"{base} {flags}"), gpus=8)
    assert p.model.vocab_size == vocab_size
    assert p.assumed == assumed


@pytest.mark.parametrize("flags, message", [
    ("", "the vocabulary size is unknown (no --tokenizer-type): add --vocab-size N, the tokenizer's size before "
         "Megatron-LM pads it"),
    ("--tokenizer-type SentencePieceTokenizer --tokenizer-model $2",
     "the vocabulary size is unknown (--tokenizer-type SentencePieceTokenizer --tokenizer-model $2): add --vocab-size "
     "N, the tokenizer's size before Megatron-LM pads it"),
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model my-org/my-tokenizer",
     "the vocabulary size is unknown (--tokenizer-type HuggingFaceTokenizer --tokenizer-model my-org/my-tokenizer): "
     "add --vocab-size N, the tokenizer's size before Megatron-LM pads it"),
    ("--tokenizer-type NullTokenizer", "the vocabulary size is unknown (--tokenizer-type NullTokenizer): add "
                                       "--vocab-size N, the tokenizer's size before Megatron-LM pads it"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-size 50000",
     "--vocab-size (50000) contradicts --tokenizer-type GPT2BPETokenizer (50257 tokens, which Megatron-LM uses)"),
    ("--vocab-size 50257 --make-vocab-size-divisible-by 100",
     "--make-vocab-size-divisible-by 100: Megatron-LM pads the vocabulary (50257) to 50300, a multiple of 100 x TP 1; "
     "vtrain pads to multiples of 128 x TP and 50300 is not one: not modelled by vtrain yet"),
])
def test_vocabulary_errors(flags, message):
    base = BASE.replace(" --vocab-size 1000", "")
    with pytest.raises(ConfigError) as exc:
        megatron_plan(read_command_line(f"{base} {flags}"), gpus=8)
    assert str(exc.value) == message


@pytest.mark.parametrize("flags, mode", [
    ("--recompute-activations", Recompute.SELECTIVE),
    ("--recompute-granularity selective --recompute-modules core_attn", Recompute.SELECTIVE),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", Recompute.FULL),
    ("--recompute-granularity full --recompute-method uniform", Recompute.FULL),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 4", Recompute.FULL),
])
def test_recompute_modes(flags, mode):
    assert plan(f"--pipeline-model-parallel-size 2 {flags}").parallel.recompute is mode  # 4 layers per stage


@pytest.mark.parametrize("flags, modules", [
    ("--recompute-granularity selective --recompute-modules mlp layernorm core_attn", ("core_attn", "layernorm", "mlp")),
    ("--recompute-granularity selective --recompute-modules core_attn", None),  # megatron-core's default
    ("--recompute-activations", None),
    ("--moe-layer-recompute", ("core_attn", "moe")),  # megatron-core adds moe to its default
    ("--recompute-granularity selective --recompute-modules mlp --moe-layer-recompute", ("mlp", "moe")),
])
def test_recompute_modules(flags, modules):
    parallel = plan(f"--pipeline-model-parallel-size 2 {flags}").parallel
    assert parallel.recompute is Recompute.SELECTIVE
    assert parallel.recompute_modules == modules


@pytest.mark.parametrize("value, freq", [("4", 4), ("'([0]*3+[1])*2'", 4), ("'[1]+[0]*7'", (1,) + (0,) * 7)])
def test_nope_layers_are_a_model_field(value, freq):
    """--no-rope-freq takes an integer or Megatron-LM's list expression; the model holds one spelling."""
    read = plan(f"--position-embedding-type rope --no-rope-freq {value}")
    assert read.model.no_rope_freq == freq and read.unmodelled == ()


def test_an_inline_yaml_list_is_read_as_its_items():
    assert parse_flags(["--recompute-modules", "[layernorm", "mlp]"]) == {"--recompute-modules": ["layernorm", "mlp"]}
    assert parse_flags(["--recompute-modules", "[moe_act]"]) == {"--recompute-modules": ["moe_act"]}


def test_recompute_modules_without_selective_are_noted():
    out = plan("--recompute-granularity full --recompute-method uniform --recompute-modules mlp")
    assert out.parallel.recompute is Recompute.FULL and out.parallel.recompute_modules is None
    assert "--recompute-modules mlp without selective recompute (Megatron-LM ignores it)" in out.unmodelled


@pytest.mark.parametrize("flags, message", [
    ("--recompute-granularity full", "--recompute-granularity full needs --recompute-method uniform or block, "
                                     "got None"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
     "--recompute-method uniform --recompute-num-layers 2: checkpoints of 2 layers are not modelled by vtrain yet "
     "(only 1)"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 2",
     "--recompute-method block --recompute-num-layers 2: recomputing 2 of the 4 layers of a chunk is not modelled "
     "by vtrain yet (only all)"),
    ("--recompute-granularity selective --recompute-modules core_attn attn_proj",
     "--recompute-modules attn_proj: must be among core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, "
     "shared_experts (megatron-core 0.16)"),
    ("--recompute-granularity full --recompute-method uniform --moe-layer-recompute",
     "--moe-layer-recompute with --recompute-granularity full: megatron-core refuses the two together"),
])
def test_recompute_refusals(flags, message):
    assert error(f"--pipeline-model-parallel-size 2 {flags}") == message


def test_virtual_pipeline_from_either_flag():
    by_layers = plan("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2", gpus=4)
    assert by_layers.parallel.virtual_pipeline == 2 and by_layers.training.schedule is ScheduleKind.INTERLEAVED_1F1B
    assert plan("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4").parallel.virtual_pipeline == 4
    assert error("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3") == (
        "--num-layers (8) / --pipeline-model-parallel-size (2) = 4 layers per stage must be a multiple of "
        "--num-layers-per-virtual-pipeline-stage (3)")


def test_sequence_parallel_and_its_megatron_quirk_at_tp1():
    assert plan("--tensor-model-parallel-size 2 --sequence-parallel").parallel.sequence_parallel
    p = plan("--sequence-parallel")
    assert not p.parallel.sequence_parallel
    assert p.unmodelled == ("--sequence-parallel at TP 1 (Megatron-LM turns it off)",)


def test_overlapped_gradient_buckets_hold_megatrons_parameter_counts():
    p = plan("--overlap-grad-reduce --bf16", gpus=64)
    assert p.training.grad_reduce is GradReduce.OVERLAP
    # max(4e7, 1e6 x 64 data-parallel ranks) parameters x 4 bytes (bf16 gradients are reduced in fp32)
    assert p.training.bucket_size_mb == 256.0
    assert plan("--overlap-grad-reduce --fp16", gpus=64).training.bucket_size_mb == 128.0
    assert plan("--overlap-grad-reduce --ddp-bucket-size 10000000").training.bucket_size_mb == 40.0  # fp32
    # --grad-reduce-in-bf16: the same parameters at 2 bytes; an fp16 model's gradients are fp16 either way
    bf16 = plan("--overlap-grad-reduce --bf16 --grad-reduce-in-bf16", gpus=64).training
    assert (bf16.grad_reduce_in_bf16, bf16.bucket_size_mb) == (True, 128.0)
    fp16 = plan("--overlap-grad-reduce --fp16 --grad-reduce-in-bf16", gpus=64).training
    assert (fp16.grad_reduce_in_bf16, fp16.bucket_size_mb) == (False, 128.0)


def test_performance_flags_are_listed_with_their_values_in_one_warning():
    p = plan("--use-flash-attn --disable-tp-comm-bulk-dgrad --attention-backend flash --disable-jit-fuser "
             "--max-position-embeddings 1024 --log-interval 10 --save /ckpt --lr 3e-4 --seed 7")
    assert p.warning == (
        "Megatron-LM arguments vtrain does not model (they may change speed or memory): "
        "--use-flash-attn, --disable-tp-comm-bulk-dgrad, --disable-jit-fuser, "
        "--max-position-embeddings 1024 (vtrain's position table has --seq-length 256 rows)")


def test_distributed_optimizer_and_uneven_pipeline_splits_map_onto_their_fields():
    p = plan("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
    assert p.training.distributed_optimizer and p.training.overlap_param_gather
    assert not plan().training.distributed_optimizer
    p = plan("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
             "--decoder-last-pipeline-num-layers 1")
    assert (p.parallel.decoder_first_pipeline_num_layers, p.parallel.decoder_last_pipeline_num_layers) == (1, 1)
    assert p.parallel.chunk_layers(p.model) == ((1,), (3,), (3,), (1,))
    # 8 layers + embedding + loss = 10 slots, 5 per rank, 1 per virtual stage: 5 virtual stages
    p = plan("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split "
             "--account-for-loss-in-pipeline-split --num-layers-per-virtual-pipeline-stage 1")
    assert p.parallel.account_for_embedding_in_pipeline_split and p.parallel.account_for_loss_in_pipeline_split
    assert p.parallel.virtual_pipeline == 5
    assert p.parallel.chunk_layers(p.model) == ((0, 1, 1, 1, 1), (1, 1, 1, 1, 0))


@pytest.mark.parametrize("flags, stack, reason", [
    ("", SoftwareStack.MEGATRON_CORE_TE, "--transformer-impl transformer_engine (Megatron-LM's default)"),
    ("--fp16", SoftwareStack.MEGATRON_CORE_TE, "--transformer-impl transformer_engine (Megatron-LM's default)"),
    ("--transformer-impl transformer_engine", SoftwareStack.MEGATRON_CORE_TE,
     "--transformer-impl transformer_engine (Megatron-LM's default)"),
    ("--transformer-impl local", SoftwareStack.MEGATRON_CORE_LOCAL,
     "--transformer-impl local: megatron-core's local layers run Megatron's fused kernels"),
    ("--use-legacy-models", SoftwareStack.MEGATRON_DEEPSPEED_2023,
     "--use-legacy-models: the legacy Megatron GPT's fused kernels"),
])
def test_the_software_stack_is_megatron_lms_transformer_impl(flags, stack, reason):
    """Regression: a script was costed with the kernels of the GPU's default (Megatron-DeepSpeed on an
    A100 for an fp16 GPT) though Megatron-LM runs TransformerEngine layers unless told otherwise."""
    p = plan(flags)
    assert (p.training.software_stack, p.stack_reason) == (stack, reason)
    assert p.training.stack_for(p.model, "ampere") is stack
    assert p.warning is None


def test_mapped_training_flags():
    p = plan("--bf16 --fp8-format hybrid --fp8-param-gather --cross-entropy-loss-fusion --cross-entropy-fusion-impl te "
             "--attention-backend flash --accumulate-allreduce-grads-in-fp32")
    assert (p.training.fp8, p.training.fp8_param_gather, p.training.cross_entropy_fusion) == (Fp8Format.HYBRID, True,
                                                                                             True)
    assert p.warning is None
    assert not plan("--bf16").training.cross_entropy_fusion and not plan("--bf16").training.fp8_param_gather


def test_deferred_embedding_wgrad_flags():
    p = plan("--bf16 --defer-embedding-wgrad-compute --wgrad-deferral-limit 2")
    assert (p.training.defer_embedding_wgrad, p.training.wgrad_deferral_limit) == (True, 2)
    assert (plan("--bf16").training.defer_embedding_wgrad, plan("--bf16").training.wgrad_deferral_limit) == (False, 0)


@pytest.mark.parametrize("flags, message", [
    ("--transformer-impl local --bf16 --fp8-format hybrid",
     "--fp8-format with --transformer-impl local: Megatron-LM runs FP8 through TransformerEngine only"),
    ("--transformer-impl inference_optimized", "--transformer-impl inference_optimized: inference layers are not "
                                               "supported by vtrain (it estimates training)"),
    ("--fp8-param-gather", "training.fp8_param_gather requires training.fp8 (FP8 weights exist only in FP8 training)"),
    ("--deterministic-mode --cross-entropy-loss-fusion", "--deterministic-mode with --cross-entropy-loss-fusion: "
                                                        "Megatron-LM refuses them together (the fused cross-entropy "
                                                        "is not deterministic)"),
    ("--cross-entropy-fusion-impl triton", "--cross-entropy-fusion-impl must be native or te, got 'triton'"),
    ("--wgrad-deferral-limit -1", "--wgrad-deferral-limit must be a non-negative integer, got -1"),
    ("--fp16 --accumulate-allreduce-grads-in-fp32", "--accumulate-allreduce-grads-in-fp32 with --fp16: fp32 "
                                                   "gradients of an fp16 model are not modelled by vtrain yet"),
    ("--window-size 128,0 --window-attn-skip-freq [0]*3+[1]", "--window-attn-skip-freq [0]*3+[1]: a per-layer "
                                                               "pattern of window layers is not modelled by vtrain yet"),
    ("--multi-latent-attention", "--multi-latent-attention without --qk-layernorm: multi-latent attention without "
                                 "the norms of its compressed query and key/value is not modelled by vtrain yet"),
    ("--enable-gpt-oss --softmax-type learnable", "--enable-gpt-oss without --window-size: vtrain reads GPT-OSS's "
                                                  "attention from the flags it stands for; state them (GPT-OSS: "
                                                  "--softmax-type learnable --window-size 127,0 "
                                                  "--window-attn-skip-freq 2)"),
    ("--fp4-format e2m1 --fp4-param-gather", "--fp4-param-gather: FP4 parameters (all-gathered in FP4) is not "
                                              "modelled by vtrain yet"),
    ("--main-grads-dtype bf16", "training.optimizer.main_grads bf16 requires training.optimizer.precision_aware "
                                "(megatron-core keeps optimizer state in fp32 otherwise)"),
    ("--disable-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag: TP overlap without its all-gather overlap is not "
                                     "modelled by vtrain yet"),
    ("--ddp-num-buckets 4", "--ddp-num-buckets 4: a DDP bucket count (--ddp-bucket-size is modelled) is not modelled "
                            "by vtrain yet"),
    ("--bert-no-binary-head", "--bert-no-binary-head: BERT models are not supported by vtrain (it estimates GPT "
                              "decoders, Megatron-LM's pretrain_gpt.py)"),
    ("--decoder-num-layers 4", "--decoder-num-layers 4: encoder-decoder (T5) models are not supported by vtrain (it "
                               "estimates GPT decoders, Megatron-LM's pretrain_gpt.py)"),
])
def test_flags_that_change_the_estimate_unmodelled_or_unsupported_are_refused_by_name(flags, message):
    assert error(flags) == message


@pytest.mark.parametrize("script, what", [
    ("pretrain_bert.py", "BERT models"), ("pretrain_t5.py", "encoder-decoder (T5) models"),
    ("pretrain_vlm.py", "vision-language models"),
    ("examples/multimodal/pretrain_vlm_llava.py", "vision-language models"),
])
def test_entry_points_other_than_pretrain_gpt_are_refused_as_unsupported(script, what):
    with pytest.raises(ConfigError) as exc:
        megatron_plan(read_command_line(f"torchrun --nproc_per_node 8 {script} {BASE}"))
    name = Path(script).name
    assert str(exc.value) == f"{name}: {what} are not supported by vtrain (it estimates GPT decoders, Megatron-LM's " \
                             f"pretrain_gpt.py)"
    assert megatron_plan(read_command_line(f"torchrun --nproc_per_node 8 pretrain_gpt.py {BASE}")).parallel.data_parallel == 8


def test_moe_feature_flags_set_the_model_fields():
    p = plan("--num-experts 8 --moe-shared-expert-intermediate-size 512 --moe-shared-expert-overlap "
             "--moe-token-dispatcher-type alltoall --moe-layer-freq '([0]*1+[1]*7)' --moe-router-score-function sigmoid "
             "--moe-router-enable-expert-bias --moe-router-num-groups 4 --moe-router-group-topk 2 "
             "--moe-router-topk-scaling-factor 2.5 --moe-expert-capacity-factor 1.25 "
             "--moe-pad-expert-input-to-capacity --moe-token-drop-policy position")
    m = p.model
    assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_overlap, m.moe_layer_freq) == (
        512, True, (0, 1, 1, 1, 1, 1, 1, 1))
    assert (m.moe_router_score_function.value, m.moe_router_enable_expert_bias, m.moe_router_num_groups,
            m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == ("sigmoid", True, 4, 2, 2.5)
    assert (m.moe_expert_capacity_factor, m.moe_pad_expert_input_to_capacity, m.moe_token_drop_policy.value) == (
        1.25, True, "position")
    assert p.unmodelled == ()
    assert plan("--num-experts 8 --moe-expert-capacity-factor -1").model.moe_expert_capacity_factor is None  # dropless
    assert plan("--num-experts 8 --moe-layer-freq 2").model.moe_layer_pattern == (True, False) * 4


def test_microbatch_groups_set_the_interleaved_schedule_and_are_ignored_without_it():
    p = plan("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 20 "
             "--microbatch-group-size-per-virtual-pipeline-stage 5", gpus=4)
    assert (p.training.schedule, p.training.microbatch_group_size) == (ScheduleKind.INTERLEAVED_1F1B, 5)
    assert plan("--pipeline-model-parallel-size 2 --microbatch-group-size-per-virtual-pipeline-stage 5",
                gpus=4).training.microbatch_group_size is None


def test_first_last_layers_bf16_sets_the_layers_outside_fp8_and_changes_nothing_without_fp8():
    fp8 = "--bf16 --fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16"
    settings = plan(f"{fp8} --num-layers-at-end-in-bf16 2").training.fp8_settings
    assert (settings.bf16_layers_at_start, settings.bf16_layers_at_end) == (1, 2)  # Megatron-LM's default: 1
    bf16 = plan("--bf16 --first-last-layers-bf16 --num-layers-at-start-in-bf16 3").training
    assert (bf16.fp8_bf16_layers_at_start, bf16.fp8_bf16_layers_at_end) == (0, 0)
    assert error(f"{fp8} --num-layers-at-start-in-bf16 -1") == (
        "--num-layers-at-start-in-bf16 must be a non-negative integer, got -1")


def test_expert_tensor_parallel_without_experts_is_ignored_as_megatron_ignores_it():
    p = plan("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 4")
    assert p.parallel.expert_tensor_parallel is None
    assert "--expert-tensor-parallel-size 4 without experts (Megatron-LM ignores it)" in p.unmodelled


def test_expert_tp_is_refused_only_with_expert_biases():
    moe = "--num-experts 8 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 --sequence-parallel"
    without = plan(f"{moe} --disable-bias-linear")  # GPT family, no biases
    without.parallel.check_fits(without.model)
    with_biases = plan(moe)
    with pytest.raises(ConfigError, match=r"^expert_tensor_parallel \(2\) must be 1 for a MoE model with linear biases"):
        with_biases.parallel.check_fits(with_biases.model)


def test_a_shell_escaped_pipeline_layout_is_read_without_its_backslashes():
    escaped = plan("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*3\\\\|\\\\(tt\\\\|\\\\)*1tL'",
                   gpus=2)
    assert escaped.parallel == plan("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
                                    "'Et*3|(tt|)*1tL'", gpus=2).parallel
