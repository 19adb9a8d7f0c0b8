"""The Bridge reader's copy of megatron-core's configuration defaults matches the installed megatron-core."""

import json

from megatron_adapters.config_defaults import DEFAULTS_PATH, megatron_core_defaults


def test_the_defaults_file_is_the_installed_megatron_cores():
    # regenerate with: python -m megatron_adapters.config_defaults
    assert json.loads(DEFAULTS_PATH.read_text()) == json.loads(json.dumps(megatron_core_defaults()))
