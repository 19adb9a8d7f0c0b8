"""Reading a launch script as bash would expand it, without running it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain_plugin.api import load_megatron_script
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.launch_script import MAX_SCRIPT_BYTES, read_command_line, read_launch_script
from vtrain_plugin.specs.megatron_args import script_plan


def args_of(script: str) -> tuple[str, ...]:
    (command,) = read_launch_script(script)
    return command.megatron_args


def test_string_variables_split_into_words_and_continuations_join_lines():
    script = '''
GPT_ARGS="
    --num-layers 24 \\
    --hidden-size 1024
"
OUT='--save $NOT_EXPANDED'
torchrun --nproc_per_node 8 pretrain_gpt.py $GPT_ARGS \\
    "$OUT" \\
    --fp16 # a comment
'''
    assert args_of(script) == ("--num-layers", "24", "--hidden-size", "1024", "--save $NOT_EXPANDED", "--fp16")


def test_arrays_quoted_and_unquoted():
    script = '''
A=( --lr 1e-4   # comment inside an array
    "--split 99,1,0" )
A+=(--seed 7)
B=("x y" z)
python -m torch.distributed.run --nnodes=2 --nproc-per-node=4 pretrain_gpt.py ${A[@]} "${B[@]}" "${B[*]}"
'''
    (command,) = read_launch_script(script)
    assert command.megatron_args == ("--lr", "1e-4", "--split", "99,1,0", "--seed", "7", "x y", "z", "x y z")
    assert (command.nnodes, command.nproc_per_node) == ("2", "4")


def test_defaults_arithmetic_and_what_cannot_be_known():
    script = '''
export NODES=${SLURM_NNODES:-4}
GPUS=$(( NODES * 2 ))
CKPT=${1:-"/ckpt/run"}
DIR=$(dirname $CKPT)
torchrun --nnodes $NODES --nproc_per_node $((GPUS / NODES)) pretrain_gpt.py --save $CKPT --load $DIR \\
    --tensorboard-dir $2 --data-path $HOME/data 2>&1 | tee log.txt
'''
    (command,) = read_launch_script(script)
    assert (command.nnodes, command.nproc_per_node) == ("4", "2")
    assert command.megatron_args == ("--save", "/ckpt/run", "--load", "$(dirname $CKPT)", "--tensorboard-dir", "$2",
                                     "--data-path", "$HOME/data")


def test_heredocs_functions_and_other_commands_are_skipped():
    script = '''
cat > config.txt <<EOF
torchrun not_this.py --num-layers 1
EOF
setup() {
    mkdir -p logs
}
setup
python tools/preprocess_data.py --input x.json
python pretrain_gpt.py --num-layers 2
'''
    (command,) = read_launch_script(script)
    assert command.megatron_args == ("--num-layers", "2")
    assert command.script == "pretrain_gpt.py" and command.nnodes is None and command.line == 10


def test_blocks_are_read_both_ways_when_the_command_reads_what_they_set():
    script = '''
ARGS=(--num-layers 2)
if [ -n "$WANDB_API_KEY" ]; then
    ARGS+=(--wandb-project p)
elif [ -n "$X" ]; then
    UNUSED=1
else
    ARGS+=(--log-interval 5)
fi
torchrun pretrain_gpt.py "${ARGS[@]}"
'''
    commands = read_launch_script(script)
    assert commands[0].blocks == (3, 7)
    assert sorted(c.megatron_args for c in commands) == sorted([
        ("--num-layers", "2", "--wandb-project", "p", "--log-interval", "5"),
        ("--num-layers", "2", "--log-interval", "5"),
        ("--num-layers", "2", "--wandb-project", "p"),
        ("--num-layers", "2")])


@pytest.mark.parametrize("script, message", [
    ("echo hello\n", "no training command found: expected torchrun, python -m torch.distributed.run or python "
                     "running a .py script (such as pretrain_gpt.py)"),
    ("torchrun pretrain_gpt.py --fp16\ntorchrun pretrain_gpt.py --bf16\n",
     "2 training commands found (lines 1, 2); keep one"),
    ("if true; then\n  torchrun pretrain_gpt.py --fp16\nfi\n",
     "line 2: the training command is inside an if/for/while/case block (line 1); vtrain reads the script without "
     "running it, so write the command outside the block"),
    ('A="unterminated\n', "line 2: unterminated double quote"),
])
def test_script_errors(script, message):
    with pytest.raises(ConfigError) as exc:
        read_launch_script(script)
    assert str(exc.value) == message


def test_a_command_line_string_joins_pasted_lines():
    assert read_command_line("--num-layers 2\n--fp16 --split '9,1,0'").megatron_args == (
        "--num-layers", "2", "--fp16", "--split", "9,1,0")
    command = read_command_line("torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 2")
    assert (command.nproc_per_node, command.megatron_args) == ("4", ("--num-layers", "2"))


def test_files_that_are_not_scripts_are_one_line_errors(tmp_path):
    binary = tmp_path / "garbage.sh"
    binary.write_bytes(b"torchrun \xff\xfe pretrain_gpt.py")
    with pytest.raises(ConfigError, match=r"garbage\.sh: not UTF-8 text \(byte 9\)$"):
        load_megatron_script(binary)
    huge = tmp_path / "huge.sh"
    huge.write_text("#" * (MAX_SCRIPT_BYTES + 1))
    with pytest.raises(ConfigError, match=r"huge\.sh: a launch script must be at most 1048576 bytes$"):
        load_megatron_script(huge)
    with pytest.raises(ConfigError, match=r"missing\.sh: cannot read: No such file or directory$"):
        load_megatron_script(tmp_path / "missing.sh")


_PIECES = ["torchrun ", "python ", "pretrain_gpt.py ", "$A", "${A[@]}", '"$A"', "'x y'", "A=(", ")", "A=", "A+=",
           "\\\n", "\n", "; ", "&& ", "| ", "2>&1 ", "<<EOF\n", "EOF\n", "if ", "then ", "else ", "fi\n", "$((", "))",
           "$(", "`", "#", "${1:-8}", " ", "--nnodes ", "--nproc_per_node ", "8 ", "{", "}", '"', "'", "\\",
           "--num-layers 2 ", "--hidden-size 64 ", "--num-attention-heads 4 ", "--seq-length 32 ",
           "--micro-batch-size 1 ", "--vocab-size 100 "]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40), st.text(max_size=5))
def test_any_text_reads_as_a_plan_or_one_config_error(pieces, tail):
    text = "".join(pieces) + tail
    for read in (read_launch_script, read_command_line):
        try:
            result = read(text)
            script_plan(result if isinstance(result, tuple) else (result,), gpus=None)
        except ConfigError:
            pass
