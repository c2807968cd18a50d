"""Settings: every MONARCH_* knob read once, bad values named with what is allowed."""

import pytest

from monarch.runtime.common.config import Settings, from_env


def test_defaults_and_values_read_from_the_environment():
    assert from_env({}) == Settings()
    s = from_env({"MONARCH_TRANSPORT": "tcp", "MONARCH_BIND_ADDR": "10.0.0.2", "MONARCH_SPIN_US": "250",
                  "MONARCH_SEND_HWM": "64", "MONARCH_GROUP_TIMEOUT": "30"})  # fmt: skip
    assert (s.transport, s.bind_addr, s.spin, s.send_hwm, s.group_timeout) == ("tcp", "10.0.0.2", 0.00025, 64, 30.0)


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("MONARCH_TRANSPORT", "udp", "MONARCH_TRANSPORT='udp'; use 'ipc' (one machine) or 'tcp' (across hosts)"),
        ("MONARCH_SPAWN_TIMEOUT", "soon", "MONARCH_SPAWN_TIMEOUT='soon' is not a number; give a number >= 1"),
        ("MONARCH_SEND_HWM", "0", "MONARCH_SEND_HWM='0' is too small; give an integer >= 1"),
        ("MONARCH_FROZEN_AFTER", "-1", "MONARCH_FROZEN_AFTER='-1' is too small; give a number >= 0"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_is_allowed(var, value, message):
    with pytest.raises(ValueError) as e:
        from_env({var: value})
    assert str(e.value) == message
