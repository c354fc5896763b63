from __future__ import annotations

from kneegate import controllers
from kneegate.controllers import CONTROLLERS, BaseControllerConfig, LimitController


def _isort_key(name: str) -> tuple[int, str]:
    # ruff's RUF022 order: CONSTANTS, then Classes, then functions
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_all_is_sorted_and_complete() -> None:
    public = {
        n
        for n, v in vars(controllers).items()
        if not n.startswith("_")
        and getattr(v, "__module__", "kneegate.controllers").startswith(
            "kneegate.controllers")
        and not isinstance(v, type(controllers))
    }
    assert controllers.__all__ == sorted(controllers.__all__, key=_isort_key)
    assert set(controllers.__all__) == public


def test_every_controller_is_registered_with_a_strict_config() -> None:
    assert sorted(CONTROLLERS) == ["aimd", "fixed", "gradient", "knee"]
    for name, (cfg_cls, ctl_cls) in CONTROLLERS.items():
        assert issubclass(cfg_cls, BaseControllerConfig)
        assert issubclass(ctl_cls, LimitController)
        assert ctl_cls.name == name
        assert cfg_cls.model_config.get("frozen") and cfg_cls.model_config.get("extra") == "forbid"
        for field_name, field in cfg_cls.model_fields.items():
            assert field.description, f"{name}.{field_name} needs a description"
