"""Reading plan files whatever their bytes: every malformed file is one ConfigError naming the file."""

import json

import pytest

from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.limits import FILE_BYTES, FILE_VALUES, NESTING_DEPTH
from vtrain_plugin.specs.reading import parse_mapping, read_mapping

# Nine levels of nine aliases: 9**9 (387 million) strings once expanded, from a few hundred bytes.
ALIAS_BOMB = b'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + b"".join(
    b"%s: &%s [%s]\n" % (new, new, b", ".join([b"*" + old] * 9)) for old, new in zip(b"abcdefgh", b"bcdefghi")
    for old, new in [(bytes([old]), bytes([new]))])


def _error(data: bytes, *, yaml_syntax: bool) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_mapping(data, yaml_syntax=yaml_syntax)
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("yaml_syntax", [False, True])
def test_binary_garbage_is_not_utf8_text(yaml_syntax):
    garbage = bytes(range(256)) * 4
    assert _error(garbage, yaml_syntax=yaml_syntax) == "not UTF-8 text: byte 0x80 at offset 128"


def test_a_bom_is_accepted_and_utf16_is_not():
    assert parse_mapping(b'\xef\xbb\xbf{"a": 1}', yaml_syntax=False) == {"a": 1}
    assert _error('{"a": 1}'.encode("utf-16"), yaml_syntax=False) == "not UTF-8 text: byte 0xff at offset 0"


@pytest.mark.parametrize("yaml_syntax", [False, True])
def test_a_file_over_the_size_limit_is_refused_before_parsing(yaml_syntax):
    data = b"a: 1\n" + b" " * FILE_BYTES.maximum
    assert _error(data, yaml_syntax=yaml_syntax) == "more than 65,536 bytes; plan files are a few hundred"


def test_read_mapping_reads_no_more_than_the_limit_of_an_endless_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^/dev/zero: more than 65,536 bytes"):
        read_mapping("/dev/zero")


@pytest.mark.parametrize("data", [b"[" * 60_000, b"[" * 500 + b"]" * 500,
                                  b'{"a": ' * (NESTING_DEPTH.maximum + 1) + b"1" + b"}" * (NESTING_DEPTH.maximum + 1)])
def test_deep_json_is_refused(data):
    assert _error(data, yaml_syntax=False) == "nested more than 32 levels deep; plan files nest two"


def test_json_at_the_depth_limit_is_read():
    depth = NESTING_DEPTH.maximum
    data = b'{"a": ' * depth + b"1" + b"}" * depth
    assert parse_mapping(data, yaml_syntax=False)["a"]


@pytest.mark.parametrize("data", [b"[" * 30_000, b"a: " + b"[" * 40 + b"]" * 40,
                                  b"a: &a [[[[[[[[[[1]]]]]]]]]]\nb: [[[[[[[[[[[[[[[[[[[[[[[[*a]]]]]]]]]]]]]]]]]]]]]]]]\n"])
def test_deep_yaml_is_refused_also_through_an_alias(data):
    assert _error(data, yaml_syntax=True) == "nested more than 32 levels deep; plan files nest two"


def test_a_yaml_alias_bomb_is_refused_before_it_is_built():
    assert _error(ALIAS_BOMB, yaml_syntax=True) == (
        "more than 10,000 values (YAML aliases expanded); plan files hold some 50")


def test_many_json_values_are_refused():
    data = json.dumps({"a": list(range(FILE_VALUES.maximum))}).encode()
    assert _error(data, yaml_syntax=False).startswith("more than 10,000 values")


def test_yaml_anchors_and_merges_are_read():
    data = b"base: &base {tensor_parallel: 2, data_parallel: 2}\nparallel:\n  <<: *base\n  data_parallel: 4\n"
    assert parse_mapping(data, yaml_syntax=True)["parallel"] == {"tensor_parallel": 2, "data_parallel": 4}


def test_a_recursive_yaml_alias_is_refused():
    assert _error(b"a: &a [1, *a]\n", yaml_syntax=True) == "YAML alias *a refers to a node that contains it"


@pytest.mark.parametrize("data,yaml_syntax,message", [
    (b'{"a": 1, "a": 2}', False, "duplicate key 'a'"),
    (b"a: 1\nb: 2\na: 3\n", True, "duplicate key 'a' at line 3 column 1"),
    (b'{"a": ' + b"9" * 5000 + b"}", False, "an integer of 5,000 digits; numbers have at most 4,300"),
    (b"a: " + b"9" * 5000, True, "an integer of 5,000 digits; numbers have at most 4,300"),
    (b"", False, "malformed JSON: Expecting value at line 1 column 1"),
    (b'{"a": 1', False, "malformed JSON: Expecting ',' delimiter at line 1 column 8"),
    (b"a: \x01", True, "malformed YAML: special characters are not allowed (position 3)"),
    (b"a:\n\tb: 1", True, "malformed YAML: found character '\\t' that cannot start any token at line 2 column 1"),
    (b"a: 2024-13-45", True, "malformed YAML: month must be in 1..12"),
    (b"a: !!python/object:os.system ls", True, "malformed YAML: could not determine a constructor for the tag "
                                               "'tag:yaml.org,2002:python/object:os.system' at line 1 column 4"),
    (b"? [1, 2]\n: 3", True, "malformed YAML: found unhashable key at line 1 column 3"),
    (b"a: *nowhere", True, "malformed YAML: found undefined alias 'nowhere' at line 1 column 4"),
    (b"- 1\n- 2", True, "the top level must be a mapping, got list"),
    (b"null", False, "the top level must be a mapping, got NoneType"),
])
def test_malformed_files_are_one_line(data, yaml_syntax, message):
    assert _error(data, yaml_syntax=yaml_syntax) == message


def test_yaml_reads_yaml_12_floats_and_every_integer_form():
    data = b"a: 270e9\nb: 2.7e+11\nc: 0x1f\nd: 1_000\ne: .inf\n"
    assert parse_mapping(data, yaml_syntax=True) == {"a": 2.7e11, "b": 2.7e11, "c": 31, "d": 1000, "e": float("inf")}


def test_read_mapping_names_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"a: [")
    with pytest.raises(ConfigError, match=rf"^{path}: malformed YAML: "):
        read_mapping(path)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'missing.json'}: cannot read: No such file or directory$"):
        read_mapping(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read: Is a directory$"):
        read_mapping(tmp_path)
