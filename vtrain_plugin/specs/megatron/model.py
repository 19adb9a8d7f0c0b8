"""The model and the recompute mode that Megatron-LM flags describe (used by
:mod:`vtrain_plugin.specs.megatron.args`).

The family (:class:`Family`) is the preset the MLP's flag picks (``--swiglu``: llama, else gpt), as
it picks Megatron-LM's default FFN size; every layer choice the flags make (normalization,
activation, linear biases, dropout, position embedding, rotary share, head dim, QK norms) is then
a ModelSpec field of its own, traced as megatron-core builds it, on every input path alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vtrain_plugin.core.dtypes import Dtype
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.attention import attention_fields
from vtrain_plugin.specs.megatron.flag_values import positive_int
from vtrain_plugin.specs.model import Activation, Family, LoadBalancing, PositionEmbedding
from vtrain_plugin.specs.model_features import POSITIONS_NOT_MODELLED, not_modelled
from vtrain_plugin.specs.parallel import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODULES, Recompute

Given = Mapping[str, Any]  # the flags a command line gives, each to its value, list of values, or True
# Tokenizers whose vocabulary size is fixed by the tokenizer itself (Megatron-LM's GPT-2 BPE files).
TOKENIZER_VOCAB_SIZES = {"GPT2BPETokenizer": 50257}
# The size of the tokenizer file a tokenizer type is written for, taken (with a note) when no
# --vocab-size is given: Llama2Tokenizer loads Llama-2's SentencePiece model (32000 tokens; Mistral's
# and Mixtral 8x7B's are 32000 too).
TOKENIZER_FILE_SIZES = {"Llama2Tokenizer": ("Llama-2's SentencePiece model", 32000)}
# HuggingFaceTokenizer's --tokenizer-model names whose size is public (len(tokenizer), what
# Megatron-LM's HuggingFaceTokenizer gives: the model cards' vocab_size, special tokens included).
HF_TOKENIZER_SIZES = {
    "gpt2": 50257,
    "meta-llama/Llama-2-7b-hf": 32000, "meta-llama/Llama-2-13b-hf": 32000, "meta-llama/Llama-2-70b-hf": 32000,
    "meta-llama/Meta-Llama-3-8B": 128256, "meta-llama/Meta-Llama-3-70B": 128256,
    "meta-llama/Llama-3.1-8B": 128256, "meta-llama/Llama-3.1-70B": 128256, "meta-llama/Llama-3.1-405B": 128256,
    "mistralai/Mistral-7B-v0.1": 32000, "mistralai/Mixtral-8x7B-v0.1": 32000,
}
MOE_LOAD_BALANCING = "aux_loss"  # the router's loss vtrain traces for several summed (megatron_adapters.moe.LOAD_BALANCING)
TRACED_LOAD_BALANCING = {b.value for b in LoadBalancing}  # one of these alone is traced as given
# What of a modelled flag is read otherwise than as given (``vtrain flags`` shows it after the module).
FLAG_NOTES = {
    "--moe-router-load-balancing-type": (
        f"one of {', '.join(b.value for b in LoadBalancing)} alone is traced as given; 'none' or several types "
        f"(summed) are traced as {MOE_LOAD_BALANCING}, with a warning"),
}
VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's default --make-vocab-size-divisible-by, which ModelSpec pads to


def _fraction(flag: str, text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} must be a number, got {text!r}") from None


def data_type(given: Given) -> Dtype:
    if given.get("--fp16") and given.get("--bf16"):
        raise ConfigError("--fp16 and --bf16 exclude each other")
    return Dtype.FP16 if given.get("--fp16") else Dtype.BF16 if given.get("--bf16") else Dtype.FP32


def model_fields(given: Given, fields: Mapping[str, Any], *, tensor_parallel: int, notes: list[str],
                 assumed: list[str]) -> dict[str, Any]:
    """The ModelSpec fields the flags give besides the directly mapped ``fields``; what is not
    modelled but accepted is appended to ``notes``, sizes taken where the flags are silent to ``assumed``."""
    for name, flag in (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                       ("num_attention_heads", "--num-attention-heads")):
        if name not in fields:
            raise ConfigError(f"{flag} is required")
    hidden = fields["hidden_size"]
    family = Family.LLAMA if given.get("--swiglu") else Family.GPT
    out: dict[str, Any] = {"family": family, "dtype": data_type(given), "seq_length": _seq_length(given, fields),
                           "tied_embeddings": not given.get("--untie-embeddings-and-output-weights"),
                           "vocab_size": vocab_size(given, tensor_parallel, assumed), **_layer(given)}
    if "--ffn-hidden-size" in given:
        out["ffn_hidden_size"] = positive_int("--ffn-hidden-size", given["--ffn-hidden-size"])
    elif family is Family.LLAMA:  # Megatron-LM's default for --swiglu: 2/3 of 4h, down to a multiple of 64
        out["ffn_hidden_size"] = int(4 * hidden * 2 / 3 / 64) * 64
    else:
        out["ffn_hidden_size"] = 4 * hidden
    if given.get("--group-query-attention"):
        out["num_query_groups"] = positive_int("--num-query-groups", given.get("--num-query-groups", 1))
    elif "--num-query-groups" in given:
        notes.append(f"--num-query-groups {given['--num-query-groups']} without --group-query-attention "
                     f"(Megatron-LM ignores it)")
    _position_table(given, out["position_embedding_type"], out["seq_length"], notes)
    out.update(attention_fields(given, notes))
    balancing = given.get("--moe-router-load-balancing-type", [MOE_LOAD_BALANCING])  # one type, or several summed
    balancing = [balancing] if isinstance(balancing, str) else balancing
    if len(set(balancing)) == 1 and balancing[0] in TRACED_LOAD_BALANCING and "--num-experts" in given:
        if balancing[0] != MOE_LOAD_BALANCING:  # one type: traced as megatron-core runs it
            out["moe_router_load_balancing_type"] = balancing[0]
    elif set(balancing) != {MOE_LOAD_BALANCING}:
        notes.append(f"--moe-router-load-balancing-type {' '.join(balancing)} (vtrain's router: {MOE_LOAD_BALANCING})")
    return out


def _seq_length(given: Given, fields: Mapping[str, Any]) -> int:
    if "seq_length" in fields:
        return fields["seq_length"]
    if "--encoder-seq-length" in given:
        return positive_int("--encoder-seq-length", given["--encoder-seq-length"])
    raise ConfigError("--seq-length is required")


def _layer(given: Given) -> dict[str, Any]:
    """The layer's ModelSpec fields as the flags set them, Megatron-LM's defaults where they are
    silent (ModelSpec stores those the family has anyway as None)."""
    if given.get("--squared-relu") and given.get("--swiglu"):
        raise ConfigError("--squared-relu and --swiglu exclude each other (Megatron-LM asserts it)")
    positions = "rope" if given.get("--use-rotary-position-embeddings") else \
        given.get("--position-embedding-type", "learned_absolute")
    if given.get("--no-position-embedding") and positions != "rope":  # with rope it changes nothing
        raise ConfigError("--no-position-embedding is deprecated in Megatron-LM; use --position-embedding-type")
    if positions in POSITIONS_NOT_MODELLED:
        raise not_modelled(f"--position-embedding-type {positions}", POSITIONS_NOT_MODELLED[positions])
    if positions not in {p.value for p in PositionEmbedding}:
        raise ConfigError(f"--position-embedding-type must be one of learned_absolute, rope, yarn, mrope, relative, "
                          f"none; got {positions!r}")
    if given.get("--quick-geglu") and (given.get("--swiglu") or given.get("--squared-relu")):
        raise ConfigError("--quick-geglu excludes --swiglu and --squared-relu (one MLP activation)")
    activation = Activation.SQUARED_RELU if given.get("--squared-relu") else \
        Activation.SILU if given.get("--swiglu") else \
        Activation.QUICK_GELU if given.get("--quick-geglu") else Activation.GELU
    out: dict[str, Any] = {
        "normalization": given.get("--normalization", "LayerNorm"),
        "activation": activation, "gated_linear_unit": bool(given.get("--swiglu") or given.get("--quick-geglu")),
        "add_bias_linear": not given.get("--disable-bias-linear"), "add_qkv_bias": bool(given.get("--add-qkv-bias")),
        "hidden_dropout": _fraction("--hidden-dropout", given.get("--hidden-dropout", 0.1)),
        "attention_dropout": _fraction("--attention-dropout", given.get("--attention-dropout", 0.1)),
        "position_embedding_type": positions,
        "rotary_percent": _fraction("--rotary-percent", given.get("--rotary-percent", 1.0)),
        "qk_layernorm": bool(given.get("--qk-layernorm")), "qk_l2_norm": bool(given.get("--qk-l2-norm") or given.get("--export-qk-l2-norm")),
        "layernorm_zero_centered_gamma": bool(given.get("--apply-layernorm-1p")),
        "glu_linear_offset": _fraction("--glu-linear-offset", given.get("--glu-linear-offset", 0.0)),
    }
    if "--activation-func-clamp-value" in given:
        out["activation_func_clamp_value"] = _fraction("--activation-func-clamp-value",
                                                       given["--activation-func-clamp-value"])
    if "--kv-channels" in given:
        out["kv_channels"] = positive_int("--kv-channels", given["--kv-channels"])
    return out


def _position_table(given: Given, positions: str, seq_length: int, notes: list[str]) -> None:
    """Learned positions: vtrain's table has ``seq_length`` rows, Megatron-LM's ``--max-position-embeddings``."""
    if positions != PositionEmbedding.LEARNED_ABSOLUTE or "--max-position-embeddings" not in given:
        return
    rows = positive_int("--max-position-embeddings", given["--max-position-embeddings"])
    if rows < seq_length:
        raise ConfigError(f"--max-position-embeddings ({rows}) must be at least --seq-length ({seq_length})")
    if rows > seq_length:
        notes.append(f"--max-position-embeddings {rows} (vtrain's position table has --seq-length {seq_length} rows)")


def vocab_size(given: Given, tensor_parallel: int, assumed: list[str]) -> int:
    """The vocabulary before ModelSpec pads it to a multiple of 128 x TP: the tokenizer's size
    (``--vocab-size``, plus the end-of-document token NullTokenizer adds: megatron-core's NullTokenizer.vocab_size is
    the given size + 1, before the padding; or the fixed size of a
    known tokenizer). Without either, the size the tokenizer's files imply (GPT-2's BPE files, a
    known tokenizer model) is taken and noted in ``assumed``; the vocabulary shapes the embedding and
    the output layer, so it is never guessed beyond that. With another ``--make-vocab-size-divisible-by``
    Megatron-LM's padded size is given, when ModelSpec's padding keeps it."""
    tokenizer = given.get("--tokenizer-type")
    if tokenizer in TOKENIZER_VOCAB_SIZES:
        size = TOKENIZER_VOCAB_SIZES[tokenizer]
        if "--vocab-size" in given and positive_int("--vocab-size", given["--vocab-size"]) != size:
            raise ConfigError(f"--vocab-size ({given['--vocab-size']}) contradicts --tokenizer-type {tokenizer} "
                              f"({size} tokens, which Megatron-LM uses)")
    elif "--vocab-size" in given:
        size = positive_int("--vocab-size", given["--vocab-size"])
        if tokenizer == "NullTokenizer":
            # megatron-core's NullTokenizer (tokenizers/text/libraries/null_tokenizer.py, as Megatron-LM's
            # training/tokenizer _NullTokenizer): vocab_size is the given size plus its end-of-document id
            size += 1
    else:
        size = _implied_vocab_size(given, assumed)
    divisor = positive_int("--make-vocab-size-divisible-by",
                           given.get("--make-vocab-size-divisible-by", VOCAB_DIVISIBLE_BY))
    if divisor == VOCAB_DIVISIBLE_BY:
        return size
    multiple = divisor * tensor_parallel
    padded = -(-size // multiple) * multiple
    if padded % (VOCAB_DIVISIBLE_BY * tensor_parallel):
        raise ConfigError(
            f"--make-vocab-size-divisible-by {divisor}: Megatron-LM pads the vocabulary ({size}) to {padded}, a "
            f"multiple of {divisor} x TP {tensor_parallel}; vtrain pads to multiples of {VOCAB_DIVISIBLE_BY} x TP "
            f"and {padded} is not one: not modelled by vtrain yet")
    return padded


def _implied_vocab_size(given: Given, assumed: list[str]) -> int:
    """The vocabulary size a tokenizer without ``--vocab-size`` implies, noted in ``assumed``; else the
    refusal names the flag to add."""
    tokenizer, model = given.get("--tokenizer-type"), given.get("--tokenizer-model")
    if tokenizer is None and "--vocab-file" in given and "--merge-file" in given:
        what, size = "--vocab-file and --merge-file (no --tokenizer-type) taken as GPT-2's BPE files", 50257
    elif tokenizer in TOKENIZER_FILE_SIZES:
        name, size = TOKENIZER_FILE_SIZES[tokenizer]
        what = f"--tokenizer-type {tokenizer} taken as {name}"
    elif tokenizer == "HuggingFaceTokenizer" and _hf_name(model):
        name = _hf_name(model)
        size = HF_TOKENIZER_SIZES[name]
        what = f"--tokenizer-model {model}" + (f" taken as {name}" if name != model else "")
    else:
        shown = " ".join(f"{flag} {given[flag]}" for flag in ("--tokenizer-type", "--tokenizer-model") if flag in given)
        raise ConfigError(f"the vocabulary size is unknown ({shown or 'no --tokenizer-type'}): add --vocab-size N, "
                          f"the tokenizer's size before Megatron-LM pads it")
    assumed.append(f"{what} ({size} tokens; add --vocab-size N if not)")
    return size


def _hf_name(model: Any) -> str | None:
    """The known Hugging Face tokenizer ``--tokenizer-model`` names: the name itself, or a local copy
    in a folder of the same name (``/models/Meta-Llama-3-8B``)."""
    if not isinstance(model, str):
        return None
    if model in HF_TOKENIZER_SIZES:
        return model
    folder = model.rstrip("/").rsplit("/", 1)[-1]
    return next((name for name in HF_TOKENIZER_SIZES if name.rsplit("/", 1)[-1] == folder), None)


def recompute_mode(given: Given, num_layers: int, num_chunks: int) -> Recompute:
    """vtrain's recompute modes: ``selective`` checkpoints the modules :func:`recompute_modules` names
    (``--moe-layer-recompute`` is selective recompute of the MoE layer, as megatron-core makes it),
    ``full`` every layer checkpointed on its own (``--recompute-method uniform --recompute-num-layers 1``,
    or ``block`` covering every layer of a chunk)."""
    granularity = "selective" if given.get("--recompute-activations") else given.get("--recompute-granularity")
    if given.get("--moe-layer-recompute"):
        if granularity == "full":
            raise ConfigError("--moe-layer-recompute with --recompute-granularity full: megatron-core refuses "
                              "the two together")
        granularity = "selective"
    if granularity is None:
        return Recompute.NONE
    if granularity == "selective":
        return Recompute.SELECTIVE
    if granularity != "full":
        raise ConfigError(f"--recompute-granularity must be full or selective, got {granularity!r}")
    method = given.get("--recompute-method")
    if method not in ("uniform", "block"):
        raise ConfigError(f"--recompute-granularity full needs --recompute-method uniform or block, got {method!r}")
    count = positive_int("--recompute-num-layers", given.get("--recompute-num-layers", 1))
    per_chunk = num_layers // num_chunks
    if (method == "uniform" and count == 1) or (method == "block" and count >= per_chunk):
        return Recompute.FULL
    if method == "uniform":
        raise ConfigError(f"--recompute-method uniform --recompute-num-layers {count}: checkpoints of "
                          f"{count} layers are not modelled by vtrain yet (only 1)")
    raise ConfigError(f"--recompute-method block --recompute-num-layers {count}: recomputing {count} of the "
                      f"{per_chunk} layers of a chunk is not modelled by vtrain yet (only all)")


def recompute_modules(given: Given, mode: Recompute, notes: list[str]) -> tuple[str, ...] | None:
    """The modules selective recompute checkpoints: ``--recompute-modules`` (megatron-core's default,
    core attention, where absent), with ``moe`` added by ``--moe-layer-recompute``; None under another
    mode, where Megatron-LM ignores ``--recompute-modules`` (noted in ``notes``)."""
    listed = given.get("--recompute-modules")
    if isinstance(listed, str):
        listed = [listed]
    if mode is not Recompute.SELECTIVE:
        if listed:
            notes.append(f"--recompute-modules {' '.join(listed)} without selective recompute (Megatron-LM ignores it)")
        return None
    modules = list(listed) if listed else list(DEFAULT_RECOMPUTE_MODULES)
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ConfigError(f"--recompute-modules {unknown[0]}: must be among {', '.join(RECOMPUTE_MODULES)}"
                          f" (megatron-core 0.16)")
    if given.get("--moe-layer-recompute") and "moe" not in modules:
        modules.append("moe")
    return tuple(modules)
