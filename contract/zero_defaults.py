"""The ``zero`` block's defaults by field name, read from ``ZeroSpec``: for code that takes a
zero field as a plain argument (the planner, the engine's strategy factory) and must default
it as a job does, without restating the value."""

from __future__ import annotations

from typing import Any

from contract.spec import ZeroSpec

ZERO_DEFAULTS: dict[str, Any] = {name: info.default for name, info in ZeroSpec.model_fields.items()}
