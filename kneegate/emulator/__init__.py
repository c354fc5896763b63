"""A GPU-free vLLM emulator: a clock-free engine core, roofline profiles, an OpenAI server.

    from kneegate.emulator import EngineCore, EngineRequest, load_profile
    core = EngineCore(load_profile("cpu-tiny"))
    core.add_request(EngineRequest("r1", prompt_tokens=128, max_tokens=64))
    while core.has_unfinished():
        result = core.step()   # result.duration engine-seconds, result.events tokens

`server.build_app(...)` serves the same core over HTTP in real time (`--speed` scales it);
`virtual.closed_loop(...)` drives it in virtual time.
"""

from __future__ import annotations

from kneegate.emulator.core import (
    CoreStats,
    EngineCore,
    EngineRequest,
    StepResult,
    TokenEvent,
)
from kneegate.emulator.profiles import Profile, list_profiles, load_profile

__all__ = [
    "CoreStats",
    "EngineCore",
    "EngineRequest",
    "Profile",
    "StepResult",
    "TokenEvent",
    "list_profiles",
    "load_profile",
]
