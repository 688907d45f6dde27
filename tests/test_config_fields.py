"""ConfigError: the one error of the settings layer, with its field, across processes."""

from __future__ import annotations

import pickle

from eplb_graph.errors import EplbError
from eplb_graph.integrations.settings import ConfigError


def test_config_error_is_a_value_error_with_field_and_pickles():
    error = ConfigError("eplb_config.window_size", "must be >= 1, got 0")
    assert isinstance(error, ValueError)
    assert str(error) == "eplb_config.window_size: must be >= 1, got 0"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.field, copy.reason, str(copy)) == (error.field, error.reason, str(error))


def test_config_error_derives_from_the_package_base():
    error = ConfigError("ep_size", "must be > 1")
    assert isinstance(error, EplbError) and isinstance(error, ValueError)
