"""Engine liveness: records each engine keeps, verdicts others draw, and the crash watcher.

Built on the storage layer only (a session lock where the store offers one, plain keys
otherwise); the maintenance layer turns verdicts into reclaim candidates.
"""

from __future__ import annotations

from .engine import EngineLiveness
from .gc import forget_engine
from .records import (
    ENGINE_RECORD_PREFIX,
    EngineRecord,
    decode_engine_record,
    encode_engine_record,
    read_engine_records,
)
from .verdicts import (
    EngineStatus,
    EngineVerdict,
    Survey,
    judge_engine,
    stale_after_ms,
    survey_engines,
    take_survey,
)
from .watcher import LivenessWatcher

__all__ = [
    "ENGINE_RECORD_PREFIX",
    "EngineLiveness",
    "EngineRecord",
    "EngineStatus",
    "EngineVerdict",
    "LivenessWatcher",
    "Survey",
    "decode_engine_record",
    "encode_engine_record",
    "forget_engine",
    "judge_engine",
    "read_engine_records",
    "stale_after_ms",
    "survey_engines",
    "take_survey",
]
