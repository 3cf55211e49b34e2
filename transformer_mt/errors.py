"""The exceptions the CLI turns into a message and an exit status, without a traceback."""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """Bad input from the user (config, data, paths): the message says what, where, and what to
    do."""


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM: the step finished and last.pt was written; the CLI exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TrainingDiverged(UserError):
    """The loss became NaN or infinite; the last checkpoint written before it is kept."""

    @classmethod
    def at(cls, loss: float, first: int, step: int, last: Path) -> "TrainingDiverged":
        kept = (
            f"the last good checkpoint is {last}"
            if last.exists()
            else "no checkpoint was written yet"
        )
        return cls(
            f"the training loss became {loss} between steps {first} and {step}; stopped, {kept} "
            "(lower train.lr_factor, raise train.warmup or set train.clip_norm)"
        )
