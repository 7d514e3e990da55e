"""The project's error types, one home each (no wording: each raise site writes its own one line).

``ParamsError`` is what loading params raises (``grpo.config.reading``); the others name what a stage
cannot do: a model param naming nothing (``ModelConfigError``), a device that cannot be used
(``DeviceError``), training stopped on purpose (``StageStop``). ``tasks/_common.py`` and the
command line map each to one line and an exit code.
"""

from __future__ import annotations


class ParamsError(ValueError):
    """Invalid parameters; the message names the offending field."""


class ModelConfigError(ValueError):
    """A model-related parameter names something that does not exist (a module, a directory)."""


class DeviceError(RuntimeError):
    """The device to compute on cannot be used (``grpo.core.device.default_device``); the message is one
    line saying what to do."""


class StageStop(RuntimeError):
    """A stage stops on purpose (training that keeps producing non-finite values); the message is
    one line saying where and what is left."""
