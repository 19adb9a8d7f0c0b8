"""Megatron-LM's own example launch scripts, as files in tests/fixtures/launch_scripts (see its README).

Each name holds the text of one script as the tests hand it to the reader; the CLI can be pointed at
the same files by hand (``vtrain estimate tests/fixtures/launch_scripts/train_gpt3_175b_distributed.sh``).
"""

from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "launch_scripts"


def _text(name: str) -> str:
    return (SCRIPTS / name).read_text()


GPT3_175B = _text("train_gpt3_175b_distributed.sh")
GPT_345M_WITH_MP = _text("pretrain_gpt_distributed_with_mp.sh")
LLAMA3_8B_FP8 = _text("train_llama3_8b_h100_fp8.sh")
MIXTRAL_8X7B = _text("train_mixtral_8x7b_distributed.sh")
LLAMA2_SLURM = _text("train_llama2_slurm.sh")
SMALL_GPT = _text("small_gpt.sh")  # a 4-layer GPT on 2 nodes of 4 GPUs (TP 2, PP 2): the logs of ../logs ran it
# The Llama-3 8B example's command line as it runs with bf16 (DTYPE="bf16") and mock data, its arrays
# written out the way a user pastes them into --megatron-args, without --use-distributed-optimizer and
# --overlap-param-gather (the tests add them back).
LLAMA3_8B_BF16_FLAGS = _text("llama3_8b_bf16.args")
