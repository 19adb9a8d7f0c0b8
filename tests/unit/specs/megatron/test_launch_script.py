"""Reading a launch script as bash would expand it, without running it."""

import os
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain_plugin.runs import load_megatron_script
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.launch_script import MAX_SCRIPT_BYTES, read_command_line, read_launch_script
from vtrain_plugin.specs.megatron.args import script_plan


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
    # $HOME is not set by the script: unset, as bash would have it in an empty environment
    assert command.megatron_args == ("--save", "/ckpt/run", "--load", "$(dirname $CKPT)", "--tensorboard-dir", "$2",
                                     "--data-path", "/data")


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
if [ -f wandb.key ]; then
    ARGS+=(--wandb-project p)
elif [ -d "$X" ]; then
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
    ("if [ -f x ]; then\n  torchrun pretrain_gpt.py --fp16\nfi\n",
     "line 2: the training command is inside an if/for/while/case block (line 1) that vtrain cannot decide without "
     "running the script; write the command outside the block"),
    ("for i in 1 2; do\n  if true; then torchrun pretrain_gpt.py --fp16; fi\ndone\n",
     "line 2: the training command is inside an if/for/while/case block (line 2) that vtrain cannot decide without "
     "running the script; write the command outside the block"),
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
           "--micro-batch-size 1 ", "--vocab-size 100 ", '${U:-"a b"}', "${U:=x}", "${A[@]:-$B}", "[ ", " ]", "[[ ",
           " ]]", "= ", "-n ", "-eq ", "! ", "elif ", "|| ", "test ", "$((${N:-8} * 2))", "$SLURM_NNODES "]


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


# Bash itself is the oracle: the same script run by bash, in an empty environment and with no
# arguments, with torchrun a function that prints its words.
_BASH_TORCHRUN = "unset PWD HOME OLDPWD; torchrun() { shift; for w in \"$@\"; do printf '[%s]\\n' \"$w\"; done; }\n"


def bash_words(script: str) -> list[str]:
    bash = shutil.which("bash")
    assert bash is not None, "bash is needed as the oracle of these tests"
    proc = subprocess.run([bash, "--norc", "--noprofile", "-c", _BASH_TORCHRUN + script], capture_output=True,
                          text=True, env={"PATH": os.defpath}, check=True, timeout=30)
    return [line[1:-1] for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("setup, words", [
    # an unset variable inside a quoted array element: one element, split when the array is unquoted
    ('A=("--data-cache-path ${PWD}/x" "--split \'99,1,0\'")', '${A[@]} "${A[@]}"'),
    # quoted: an empty word; unquoted alone: no word
    ('X="${UNSET}"', '--a "$UNSET" --b $UNSET --c "${UNSET}/y" x$UNSET "$X" $X'),
    ('N=${SLURM_NNODES:-"1"}; M=${U:-default}; K=${U-dflt}; E=""; F=${E:-"e f"}; G=${E-"g"}',
     '$N $M $K $F "$G" ${U:-"a b"} ${U:-a b} "${U:-"q r"}" ${U:-\'s t\'}x'),
    (': ${V:=assigned value}; W=${W2:="z"}', '$V "$V" $W $W2'),
    ('B="x \'y z\'"; C=\'a "b c"\'; D=(p "q r")', '$B "$B" $C "${D[*]}" ${D[*]} pre${D[@]}post "pre${D[@]}post"'),
    ('NODES=${SLURM_NNODES:-2}; G=$(( ${SLURM_GPUS_PER_NODE:-8} * NODES )); W=$((SLURM_JOB_NUM_NODES + 1))',
     '$G $W $(( $G / 4 ))'),
    ('', '${A:-${B:-"c d"}} "${A:-${B:-c d}}" ${A:+x} ${A-}y'),
    ('E=(); F=("")', '"${E[@]}" ${E[@]} "${F[@]}" $@ "$@" $#'),
    ('T=" lead  trail "', 'a${T}b "x${T}y" $T'),
])
def test_words_expand_as_bash_expands_them(setup, words):
    script = f"{setup}\ntorchrun pretrain_gpt.py {words}\n"
    (command,) = read_launch_script(script)
    assert list(command.megatron_args) == bash_words(script)


@pytest.mark.parametrize("script", [
    'USE_FP8=1\nARGS=(--bf16)\nif [ "$USE_FP8" = 1 ]; then ARGS+=(--fp8-format hybrid); fi',
    'DTYPE="fp8"\nARGS=()\nif [[ "$DTYPE" == "fp8" ]]; then\n  ARGS+=("--fp8-format hybrid")\nfi',
    'T=${3:-"MOCK"}\nARGS=()\nif [[ "$T" == "MOCK" ]] || [[ -z "$T" ]]; then\n ARGS+=(--mock-data)\nelse\n'
    ' ARGS+=(--data-path x)\nfi',
    'N=4\nARGS=()\nif [ $N -gt 8 ]; then ARGS+=(a)\nelif [ $N -ge 4 ] && ! [ -n "$WANDB_API_KEY" ]; then ARGS+=(b)\n'
    'else ARGS+=(c)\nfi',
    'ARGS=()\nif [ -n "${WANDB_API_KEY}" ]; then\n ARGS+=(--wandb-project p)\nfi\n'
    'if test -z $UNSET; then ARGS+=(--z); fi\n'
    'if [ ! "$X" ]; then ARGS+=(--notx); fi',
    'ARGS=()\nif false || true; then ARGS+=(t); fi\nif [ -n $UNSET ]; then ARGS+=(quirk); fi\n'
    'if [[ -n $UNSET ]]; then ARGS+=(no); fi',
    'X=1\nARGS=()\nif [ "$X" != 1 ]; then ARGS+=(a); elif [ "$X" -eq 1 ]; then ARGS+=(b); fi',
])
def test_if_blocks_on_literal_settings_are_decided_as_bash_decides_them(script):
    script += '\ntorchrun pretrain_gpt.py "${ARGS[@]}"\n'
    (command,) = read_launch_script(script)
    assert command.blocks == ()
    assert list(command.megatron_args) == bash_words(script)


def test_a_training_command_inside_a_decided_if_is_read():
    script = ('FP8=1\nif [ "$FP8" = 1 ]; then\n  torchrun pretrain_gpt.py --fp8-format hybrid\n'
              'else\n  torchrun x.py\nfi\n')
    (command,) = read_launch_script(script)
    assert command.megatron_args == tuple(bash_words(script)) == ("--fp8-format", "hybrid")


@pytest.mark.parametrize("condition", [
    "[ -f wandb.key ]",  # a file
    '[[ "$DTYPE" == fp* ]]',  # a pattern
    '[ "$(hostname)" = node0 ]',  # a command's output
    "[ $DTYPE = fp8 -a -n x ]",  # -a / -o
    "grep -q fp8 config.txt",  # a command
    '[ "$SET_IN_A_BLOCK" = 1 ]',  # a value set inside an undecided block
])
def test_conditions_not_known_without_running_the_script_are_read_both_ways(condition):
    script = f"""DTYPE=fp8
ARGS=()
if [ -f x ]; then SET_IN_A_BLOCK=1; fi
if {condition}; then
    ARGS+=(--fp8-format hybrid)
fi
torchrun pretrain_gpt.py "${{ARGS[@]}}"
"""
    commands = read_launch_script(script)
    assert sorted(c.megatron_args for c in commands) == [(), ("--fp8-format", "hybrid")]
    assert 4 in commands[0].blocks


def test_the_scripts_arguments_are_not_given():
    script = 'CKPT=$1\ntorchrun pretrain_gpt.py --save $CKPT --load "${1:-/ckpt}" --split ${2-9,1} "$@"\n'
    (command,) = read_launch_script(script)
    # a bare $1 is a path the script is run with: kept as its own text (bash would drop it)
    assert command.megatron_args == ("--save", "$1", "--load", "/ckpt", "--split", "9,1")


def test_a_node_count_from_an_unset_variable_is_unknown():
    (command,) = read_launch_script("torchrun --nnodes $SLURM_NNODES --nproc-per-node 8 --node_rank 0 "
                                    "pretrain_gpt.py\n")
    assert (command.nnodes, command.nproc_per_node) == ("", "8")
    with pytest.raises(ConfigError) as exc:
        command.num_gpus(None)
    assert str(exc.value) == ("the GPU count is unknown: torchrun --nnodes (empty) x --nproc-per-node 8 is not a "
                              "product of whole numbers; give --gpus N")
    assert command.num_gpus(64) == (64, None)
    (command,) = read_launch_script("torchrun --nnodes ${SLURM_JOB_NUM_NODES:-2} --nproc-per-node "
                                    "$(( ${SLURM_GPUS_PER_NODE:-8} / 2 )) pretrain_gpt.py\n")
    assert command.num_gpus(None) == (8, None)


def test_environment_variables_given_to_the_reader():
    script = ('NNODES=${SLURM_NNODES:-1}\nif [ "$MODEL_SIZE" = 70B ]; then L=80; else L=32; fi\n'
              'torchrun --nnodes $NNODES --nproc-per-node 8 pretrain_gpt.py --num-layers $L --data-path "$HOME/d"\n')
    (plain,) = read_launch_script(script)
    assert (plain.nnodes, plain.megatron_args) == ("1", ("--num-layers", "32", "--data-path", "/d"))
    (given,) = read_launch_script(script, {"SLURM_NNODES": "64", "MODEL_SIZE": "70B", "HOME": "/home/me"})
    assert (given.nnodes, given.megatron_args) == ("64", ("--num-layers", "80", "--data-path", "/home/me/d"))
