"""The settings registry: every VLAUNCH_* variable typed, defaulted and read in one place."""

from __future__ import annotations

import logging

import pytest

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.engine_env import EngineEnv, env_name
from vlaunch.cache.contract.errors import UsageError


def test_unset_and_empty_are_the_default_and_whitespace_is_trimmed() -> None:
    for name, setting in settings.REGISTRY.items():
        assert settings.get(name, {}) == setting.default, name
        assert settings.get(name, {name: "  "}) == setting.default, name
    assert settings.get("VLAUNCH_READER", {"VLAUNCH_READER": " register "}) == "register"
    assert settings.get("VLAUNCH_SPLIT_READ", {"VLAUNCH_SPLIT_READ": ""}) == "gather"


def test_an_unregistered_name_is_a_bug_not_a_default() -> None:
    with pytest.raises(KeyError):
        settings.get("VLAUNCH_NOT_A_SETTING", {})


def test_seconds_take_positive_numbers_and_fall_back_otherwise() -> None:
    for raw, want in (("2.5", 2.5), ("0", 30.0), ("-1", 30.0), ("soon", 30.0)):
        assert settings.get("VLAUNCH_IO_TIMEOUT", {"VLAUNCH_IO_TIMEOUT": raw}) == want, raw
    assert settings.get("VLAUNCH_WATCH_EVERY", {"VLAUNCH_WATCH_EVERY": "1e7"}) == 5.0
    assert settings.get("VLAUNCH_STARVED_AFTER", {"VLAUNCH_STARVED_AFTER": "3"}) == 3.0


def test_a_connection_bound_is_taken_as_given_when_it_is_a_positive_integer() -> None:
    for raw, want in (("100", 100), ("0", None), ("many", None), ("-3", None)):
        assert settings.get("VLAUNCH_MAX_CONNECTIONS", {"VLAUNCH_MAX_CONNECTIONS": raw}) == want


def test_a_bad_reader_warns_and_bad_slab_settings_stop_the_rank(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert settings.get("VLAUNCH_READER", {"VLAUNCH_READER": "dma"}) == "staging"
    assert "VLAUNCH_READER=dma is not one of staging, register" in caplog.text
    with pytest.raises(UsageError, match="VLAUNCH_CPU_SLAB_PAGES must be auto or 4k"):
        settings.get("VLAUNCH_CPU_SLAB_PAGES", {"VLAUNCH_CPU_SLAB_PAGES": "2m"})
    with pytest.raises(UsageError, match="file-backed CPU slabs are no longer supported"):
        settings.get("VLAUNCH_CPU_SLABS", {"VLAUNCH_CPU_SLABS": "file"})
    assert settings.get("VLAUNCH_CPU_SLABS", {"VLAUNCH_CPU_SLABS": "memfd"}) == "memfd"


def test_every_engine_environment_field_is_a_registered_engine_setting() -> None:
    fields = {env_name(f) for f in EngineEnv._fields}
    assert fields <= set(settings.REGISTRY)
    assert all(settings.REGISTRY[n].kind == settings.ENGINE for n in fields)
    for name in fields:  # the field's default is the setting's
        field = name.removeprefix("VLAUNCH_").lower()
        assert EngineEnv._field_defaults[field] == settings.REGISTRY[name].default, name


def test_engine_fields_parse_as_before() -> None:
    env = EngineEnv.from_env({"VLAUNCH_RANKS": "0, 2,", "VLAUNCH_PRELOAD": "no",
                              "VLAUNCH_ATTEMPT": "0", "VLAUNCH_ENGINE_DEVICES": "cuda:0,,cpu"})
    assert (env.ranks, env.preload, env.attempt, env.engine_devices) == (
        (0, 2), False, 0, ("cuda:0", "cpu"))
    for name, raw in (("VLAUNCH_ATTEMPT", "-1"), ("VLAUNCH_RANKS", "0,x"),
                      ("VLAUNCH_DATA_PARALLEL_SIZE", "0")):
        with pytest.raises(UsageError, match=f"{name}={raw!r} is malformed"):
            EngineEnv.from_env({name: raw})


def test_every_setting_says_what_it_is() -> None:
    for setting in settings.REGISTRY.values():
        assert setting.name.startswith("VLAUNCH_") and setting.doc.endswith((".", ")")), setting
        assert setting.kind in (settings.KNOB, settings.ENGINE, settings.INTERNAL), setting
        assert setting.shown, setting
