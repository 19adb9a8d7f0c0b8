"""The command-line arguments of Megatron-LM's ``pretrain_gpt.py``, as data.

Re-typed from ``megatron/training/arguments.py`` (Megatron-LM core_r0.12 to 0.16; the megatron-core
wheel does not ship ``megatron/training``), grouped as that file groups them. Each word is one flag
without its leading ``--``: ``name`` takes one value, ``name!`` is a switch (store_true or
store_false), ``name*`` takes a list of values. A flag missing here is refused as "not a Megatron-LM
argument vtrain knows": add it to its group.

:data:`PERFORMANCE_FLAGS` are the flags that change the speed or memory of training by a
second-order amount that vtrain does not model; they are accepted and listed in one warning. Flags
that shape the plan are mapped in
:mod:`vtrain_plugin.specs.megatron.args`; every other flag (logging, checkpointing, data paths,
learning-rate schedule...) changes nothing vtrain predicts and is accepted silently.
"""

from __future__ import annotations

from enum import Enum

_NETWORK_SIZE = """
num-layers encoder-num-layers decoder-num-layers hidden-size ffn-hidden-size num-attention-heads
attention-backend kv-channels group-query-attention! num-query-groups max-position-embeddings
position-embedding-type relative-attention-num-buckets relative-attention-max-distance
use-rotary-position-embeddings! rotary-base rotary-percent rotary-interleaved!
rotary-seq-len-interpolation-factor use-rope-scaling! rope-scaling-factor no-rope-freq mrope-section*
no-position-embedding! make-vocab-size-divisible-by normalization norm-epsilon apply-layernorm-1p!
apply-residual-connection-post-layernorm! openai-gelu! squared-relu! swiglu! onnx-safe
quick-geglu! glu-linear-offset activation-func-clamp-value export-qk-l2-norm!
bert-no-binary-head! num-experts untie-embeddings-and-output-weights! multi-latent-attention!
mtp-num-layers mtp-loss-scaling-factor qk-layernorm! qk-l2-norm! window-size window-attn-skip-freq
softmax-type enable-gpt-oss!
is-hybrid-model! hybrid-attention-ratio hybrid-mlp-ratio hybrid-override-pattern hybrid-layer-pattern
mamba-state-dim mamba-head-dim mamba-num-groups mamba-num-heads disable-mamba-mem-eff-path!
heterogeneous-layers-config-path heterogeneous-layers-config-encoded-json
"""
_REGULARIZATION = """
attention-dropout hidden-dropout weight-decay start-weight-decay end-weight-decay weight-decay-incr-style
clip-grad adam-beta1 adam-beta2 adam-eps sgd-momentum
"""
_TRAINING = """
micro-batch-size batch-size global-batch-size rampup-batch-size* decrease-batch-size-if-needed!
recompute-activations! recompute-granularity check-for-nan-in-loss-and-grad!
no-check-for-nan-in-loss-and-grad! check-for-spiky-loss! check-for-large-grads!
distribute-saved-activations! recompute-method recompute-num-layers recompute-modules*
no-clone-scatter-output-in-embedding! profile! profile-step-start profile-step-end profile-ranks*
iterations-to-skip* result-rejected-tracker-filename disable-gloo-process-groups! use-pytorch-profiler!
record-memory-history! memory-snapshot-path tp-comm-overlap! tp-comm-overlap-cfg
disable-tp-comm-overlap-ag! disable-tp-comm-overlap-rs! tp-comm-overlap-rs-dgrad!
disable-tp-comm-bulk-dgrad! disable-tp-comm-bulk-wgrad! disable-tp-comm-split-ag!
disable-tp-comm-split-rs! tp-comm-bootstrap-backend use-cpu-initialization! empty-unused-memory-level
deterministic-mode! check-weight-hash-across-dp-replicas-interval calculate-per-token-loss! train-iters
train-samples log-interval exit-interval exit-duration-in-mins exit-signal-handler! exit-signal
tensorboard-dir no-masked-softmax-fusion! no-bias-gelu-fusion! no-bias-swiglu-fusion!
use-fused-weighted-squared-relu! no-bias-dropout-fusion! no-rope-fusion! cross-entropy-loss-fusion!
cross-entropy-fusion-impl use-flash-attn! disable-bias-linear! add-qkv-bias! optimizer
optimizer-cpu-offload! optimizer-offload-fraction use-torch-optimizer-for-cpu-offload!
overlap-cpu-optimizer-d2h-h2d! no-pin-cpu-grads! no-pin-cpu-params! dataloader-type
no-async-tensor-model-parallel-allreduce! no-persist-layer-norm! sequence-parallel!
no-gradient-accumulation-fusion! use-mcore-models! use-legacy-models! manual-gc! manual-gc-interval
no-manual-gc-eval! pipeline-model-parallel-comm-backend high-priority-stream-groups* spec*
yaml-cfg enable-experimental! delay-wgrad-compute!
"""
_INITIALIZATION = """
seed data-parallel-random-init! init-method-std embedding-init-method-std init-method-xavier-uniform!
"""
_LEARNING_RATE = """
lr lr-decay-style lr-wsd-decay-style lr-decay-iters lr-decay-samples lr-wsd-decay-samples
lr-wsd-decay-iters lr-warmup-fraction lr-warmup-iters lr-warmup-samples lr-warmup-init warmup min-lr
override-opt_param-scheduler! use-checkpoint-opt_param-scheduler! decoupled-lr decoupled-min-lr
"""
_CHECKPOINTING = """
save save-interval save-retain-interval no-save-optim! no-save-rng! load no-load-optim!
load-main-params-from-ckpt! no-load-rng! non-persistent-save-interval non-persistent-ckpt-type
non-persistent-global-ckpt-dir non-persistent-local-ckpt-dir non-persistent-local-ckpt-algo finetune!
pretrained-checkpoint ckpt-step no-initialization! use-checkpoint-args! use-mp-args-from-checkpoint-args!
use-tokenizer-model-from-checkpoint-args! exit-on-missing-checkpoint! use-dist-ckpt!
use-persistent-ckpt-worker! auto-detect-ckpt-format! dist-ckpt-format ckpt-format ckpt-convert-format
ckpt-convert-save ckpt-convert-update-legacy-dist-opt-format! ckpt-fully-parallel-save!
no-ckpt-fully-parallel-save! async-save! ckpt-fully-parallel-load! ckpt-assume-constant-structure!
dist-ckpt-strictness load-model-opt-format!
"""
_MIXED_PRECISION = """
fp16! bf16! grad-reduce-in-bf16! loss-scale initial-loss-scale min-loss-scale loss-scale-window
hysteresis fp32-residual-connection! apply-query-key-layer-scaling! attention-softmax-in-fp32!
accumulate-allreduce-grads-in-fp32! fp16-lm-cross-entropy! disable-bf16-reduced-precision-matmul!
reuse-grad-buf-for-mxfp8-param-ag! main-grads-dtype main-params-dtype exp-avg-dtype exp-avg-sq-dtype
use-precision-aware-optimizer!
"""
_TRANSFORMER_ENGINE = """
fp8-format fp8-recipe fp8-margin fp8-interval fp8-amax-history-len fp8-amax-compute-algo no-fp8-wgrad!
transformer-impl fp8-param-gather! first-last-layers-bf16! num-layers-at-start-in-bf16
num-layers-at-end-in-bf16 te-rng-tracker! inference-rng-tracker! fp4-format fp4-recipe fp4-param!
"""
_DISTRIBUTED = """
tensor-model-parallel-size pipeline-model-parallel-size decoder-first-pipeline-num-layers
decoder-last-pipeline-num-layers pipeline-model-parallel-layout model-parallel-size
num-layers-per-virtual-pipeline-stage num-virtual-stages-per-pipeline-rank
microbatch-group-size-per-virtual-pipeline-stage no-overlap-p2p-communication!
overlap-p2p-communication-warmup-flush! distributed-backend distributed-timeout-minutes
overlap-grad-reduce! defer-embedding-wgrad-compute! wgrad-deferral-limit no-align-grad-reduce!
ddp-num-buckets ddp-bucket-size ddp-pad-buckets-for-high-nccl-busbw! ddp-average-in-collective!
overlap-param-gather! overlap-param-gather-with-optimizer-step! no-align-param-gather!
no-scatter-gather-tensors-in-pipeline! use-ring-exchange-p2p! local-rank lazy-mpu-init
account-for-embedding-in-pipeline-split! account-for-loss-in-pipeline-split! use-distributed-optimizer!
num-distributed-optimizer-instances use-nccl-ub! use-sharp! use-custom-fsdp! use-megatron-fsdp!
data-parallel-sharding-strategy init-model-with-meta-device! use-torch-fsdp2!
torch-fsdp2-no-reshard-after-forward! suggested-communication-unit-size keep-fp8-transpose-cache!
context-parallel-size cp-comm-type* hierarchical-context-parallel-sizes* nccl-communicator-config-path
use-tp-pp-dp-mapping! encoder-tensor-model-parallel-size encoder-pipeline-model-parallel-size
pipeline-model-parallel-split-rank enable-cuda-graph! cuda-graph-impl cuda-graph-scope
cuda-graph-warmup-steps external-cuda-graph!
"""
_VALIDATION = """
eval-iters eval-interval test-mode! skip-train! full-validation! multiple-validation-sets!
"""
_DATA_AND_TOKENIZER = """
data-path* split train-data-path* valid-data-path* test-data-path* data-args-path
per-split-data-args-path data-cache-path mock-data! seq-length encoder-seq-length decoder-seq-length
retriever-seq-length sample-rate mask-prob short-seq-prob num-workers reset-position-ids!
reset-attention-mask! eod-mask-loss! no-create-attention-mask-in-dataloader! num-dataset-builder-threads
object-storage-cache-path mid-level-dataset-surplus no-mmap-bin-files! s3-cache-path sft!
sft-tokenizer-prompt-format fim-data! fim-rate fim-spm-rate fim-split-sample fim-fragment-rate
fim-no-prefix vocab-size vocab-file merge-file vocab-extra-ids tokenizer-type tokenizer-model
tokenizer-metadata tokenizer-special-tokens* tokenizer-hf-use-fast! tokenizer-hf-include-special-tokens!
tokenizer-sentencepiece-legacy! trust-remote-code! legacy-tokenizer! tiktoken-pattern
tiktoken-num-special-tokens tiktoken-special-tokens*
"""
_MOE = """
expert-model-parallel-size expert-tensor-parallel-size moe-ffn-hidden-size
moe-shared-expert-intermediate-size moe-shared-expert-overlap! moe-layer-freq moe-grouped-gemm!
moe-use-legacy-grouped-gemm! moe-router-load-balancing-type moe-router-dtype moe-router-score-function
moe-router-topk moe-router-pre-softmax! moe-router-num-groups moe-router-group-topk
moe-router-topk-scaling-factor moe-router-enable-expert-bias! moe-router-bias-update-rate
moe-router-force-load-balancing! moe-router-padding-for-fp8! moe-router-fusion! moe-aux-loss-coeff
moe-z-loss-coeff moe-input-jitter-eps moe-per-layer-logging! moe-token-dispatcher-type moe-enable-deepep!
moe-deepep-num-sms moe-permute-fusion! moe-extended-tp! moe-use-upcycling! moe-upcycling-granularity
moe-token-drop-policy moe-expert-capacity-factor moe-pad-expert-input-to-capacity! moe-layer-recompute!
moe-apply-probs-on-input!
"""
_MLA = """
q-lora-rank kv-lora-rank qk-head-dim qk-pos-emb-head-dim v-head-dim rotary-scaling-factor mscale
mscale-all-dim cache-mla-latents!
"""
_LOGGING = """
log-params-norm! log-num-zeros-in-grad! log-throughput! log-progress! timing-log-level log-energy!
barrier-with-L1-time! timing-log-option tensorboard-log-interval tensorboard-queue-size
log-timers-to-tensorboard! no-log-loss-scale-to-tensorboard! log-validation-ppl-to-tensorboard!
log-memory-to-tensorboard! log-world-size-to-tensorboard! wandb-project wandb-exp-name wandb-save-dir
wandb-entity logging-level log-straggler! disable-straggler-on-startup! straggler-ctrlr-port
straggler-minmax-count run-workload-inspector-server! no-one-logger! one-logger-project
one-logger-run-name one-logger-async! app-tag-run-name app-tag-run-version config-logger-dir
enable-ft-package! calc-ft-timeouts! inprocess-restart! adlr-autoresume! adlr-autoresume-interval
error-injection-rate error-injection-type rerun-mode disable-msc!
"""
_INFERENCE = """
inference-batch-times-seqlen-threshold max-tokens-to-oom output-bert-embeddings! bert-embedder-type
flash-decode! inference-max-requests inference-max-seq-length inference-dynamic-batching!
"""
_GROUPS = (_NETWORK_SIZE, _REGULARIZATION, _TRAINING, _INITIALIZATION, _LEARNING_RATE, _CHECKPOINTING,
           _MIXED_PRECISION, _TRANSFORMER_ENGINE, _DISTRIBUTED, _VALIDATION, _DATA_AND_TOKENIZER, _MOE, _MLA,
           _LOGGING, _INFERENCE)


class Arity(Enum):
    SWITCH = 0  # store_true / store_false
    ONE = 1  # one value
    LIST = 2  # nargs='*' or '+'


def _read(groups: tuple[str, ...]) -> dict[str, Arity]:
    flags: dict[str, Arity] = {}
    for group in groups:
        for word in group.split():
            arity = {"!": Arity.SWITCH, "*": Arity.LIST}.get(word[-1], Arity.ONE)
            name = "--" + word.rstrip("!*")
            assert name not in flags, f"{name} listed twice"
            flags[name] = arity
    return flags


MEGATRON_FLAGS: dict[str, Arity] = _read(_GROUPS)

# Flags that change the speed or memory of training by a second-order amount, or in a way vtrain
# already assumes: accepted, and listed in one warning. A flag with a first-order effect that vtrain
# does not model is refused instead (megatron_args.FIELDS); one it models is mapped there.
PERFORMANCE_FLAGS = frozenset("--" + word for word in (
    # Tunings of TransformerEngine's TP overlap, which vtrain models as a whole (training.tp_comm_overlap)
    """tp-comm-overlap-cfg tp-comm-overlap-rs-dgrad disable-tp-comm-bulk-dgrad disable-tp-comm-bulk-wgrad
    disable-tp-comm-split-ag disable-tp-comm-split-rs use-nccl-ub """
    # Elementwise fusions turned off, or reduced-precision settings of small kernels: memory-bound
    # kernels of a few per cent of a layer's time, next to GEMMs and attention that they leave alone
    """no-masked-softmax-fusion no-bias-gelu-fusion no-bias-swiglu-fusion no-bias-dropout-fusion no-rope-fusion
    no-persist-layer-norm no-gradient-accumulation-fusion use-fused-weighted-squared-relu
    disable-bf16-reduced-precision-matmul attention-softmax-in-fp32 use-flash-attn """
    # When pipeline and data-parallel transfers are issued, not their size, which vtrain times
    """no-overlap-p2p-communication overlap-p2p-communication-warmup-flush no-align-grad-reduce
    no-align-param-gather ddp-pad-buckets-for-high-nccl-busbw use-ring-exchange-p2p
    no-scatter-gather-tensors-in-pipeline nccl-communicator-config-path pipeline-model-parallel-comm-backend
    high-priority-stream-groups defer-embedding-wgrad-compute no-async-tensor-model-parallel-allreduce """
    # The caching allocator's reserve, and the first iterations of a batch-size ramp (vtrain predicts
    # the steady iteration)
    """empty-unused-memory-level rampup-batch-size """
    # MoE router and permutation kernels (small next to the experts' GEMMs); the legacy grouped GEMM
    # (--moe-grouped-gemm itself is modelled: model.moe_grouped_gemm)
    """moe-use-legacy-grouped-gemm moe-permute-fusion moe-router-fusion moe-router-dtype
    moe-z-loss-coeff moe-input-jitter-eps moe-router-padding-for-fp8 moe-apply-probs-on-input"""
).split())

# Models other than a GPT decoder, which vtrain does not estimate: the flags only those take.
UNSUPPORTED_FLAGS = {
    **dict.fromkeys(("--bert-no-binary-head", "--output-bert-embeddings", "--bert-embedder-type"), "BERT models"),
    **dict.fromkeys(("--decoder-num-layers", "--decoder-seq-length", "--pipeline-model-parallel-split-rank"),
                    "encoder-decoder (T5) models"),
    **dict.fromkeys(("--encoder-tensor-model-parallel-size", "--encoder-pipeline-model-parallel-size"),
                    "a separately parallelised encoder (T5, vision-language models)"),
    "--retriever-seq-length": "retrieval (RETRO) models",
}
# Megatron-LM's entry points other than pretrain_gpt.py, by the model family they train.
UNSUPPORTED_SCRIPTS = {"pretrain_bert": "BERT models", "pretrain_t5": "encoder-decoder (T5) models",
                       "pretrain_vlm": "vision-language models",
                       "pretrain_retro": "retrieval (RETRO) models", "pretrain_ict": "retrieval (ICT) models",
                       "pretrain_vision": "vision models"}

# Retired flags that Megatron-LM still parses only to refuse them, with the flag that replaced each.
RETIRED_FLAGS = {"--batch-size": "--micro-batch-size", "--model-parallel-size": "--tensor-model-parallel-size",
                 "--warmup": "--lr-warmup-fraction"}
