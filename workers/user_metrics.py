"""Scalars the user's own code reports, sent with each step's metric record.

The public API is one function::

    from workers.user_metrics import report

    report({"accuracy": acc, "aux_loss": aux})   # or report(accuracy=acc)

callable from anything the job runs: a model's ``forward``, a data or model factory. Each rank
collects what its code reported during a step; the step's record carries the mean of each
name's values (``report`` called once per micro-batch gives the step's mean) and the job page
charts the mean over ranks ("Your metrics"). Values reported while the job evaluates (the
spec's ``eval`` block) are recorded as ``eval/<name>``; values reported before the first step
(a factory's) go with the first step.

A value is a number or a one-element tensor (``float()`` of a CUDA tensor waits for the
device, as ``.item()`` does). What breaks a rule (``contract.metrics``: a name that is not 1 to
64 characters of text, a value that is not a finite number, a name past the job's
``MAX_USER_METRICS``) is dropped with one warning in the job's log per name, never failing the
job: a metric is worth less than the training that reports it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

from contract.metrics import EVAL_PREFIX, MAX_USER_METRICS, user_metric_name_problem

log = logging.getLogger(__name__)

MAX_WARNINGS = 20  # then one last line says that further drops are not logged


class Collector:
    """One process's reports between two ``take()`` calls (one training step)."""

    def __init__(self, max_names: int = MAX_USER_METRICS):
        self.max_names = max_names
        self.reset()

    def reset(self) -> None:
        """Forget everything: a training run starts (``train_loop`` calls it before building the job)."""
        self.names: set[str] = set()  # accepted during the run: the job's bound applies to them
        self._sums: dict[str, list[float]] = {}  # name -> [sum, count] of this step
        self._prefix = ""
        self._warned: set[str] = set()
        self._silenced = False

    def report(self, values: Mapping[str, Any]) -> None:
        if not isinstance(values, Mapping):
            self._drop("<report>", f"report() takes a mapping of names to numbers, not {type(values).__name__}")
            return
        for name, value in values.items():
            problem = user_metric_name_problem(name)
            full = f"{self._prefix}{name}" if problem is None else (name if isinstance(name, str) else repr(name))[:80]
            if problem is None:
                problem = user_metric_name_problem(full)
            number = None if problem else _number(value)
            if problem is None and number is None:
                problem = f"the value must be a finite number (got {_describe(value)})"
            if problem is None and full not in self.names and len(self.names) >= self.max_names:
                problem = f"a job records at most {self.max_names} names"
            if problem is not None:
                self._drop(full, problem)
                continue
            self.names.add(full)
            entry = self._sums.setdefault(full, [0.0, 0])
            entry[0] += number
            entry[1] += 1

    def _drop(self, name: str, problem: str) -> None:
        if name in self._warned or self._silenced:
            return
        if len(self._warned) >= MAX_WARNINGS:
            self._silenced = True
            log.warning("user metrics: more values dropped; no further warnings")
            return
        self._warned.add(name)
        log.warning("user metric %r dropped: %s", name, problem)

    def take(self) -> dict[str, float]:
        """The step's means by name (finite: a mean of finite values can overflow), and a fresh step."""
        sums, self._sums = self._sums, {}
        means = {name: total / count for name, (total, count) in sums.items()}
        return {name: value for name, value in means.items() if math.isfinite(value)}

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Reports inside are the evaluation's: recorded as ``eval/<name>``."""
        self._prefix = EVAL_PREFIX
        try:
            yield
        finally:
            self._prefix = ""


def _number(value: Any) -> float | None:
    if isinstance(value, (str, bytes, bool)):
        return None
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, numbers.Real):
        try:
            value = item()  # a one-element tensor or a numpy scalar
        except (ValueError, RuntimeError, TypeError):
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):  # an int too large for a float
        return None
    return number if math.isfinite(number) else None


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


COLLECTOR = Collector()  # this process's: the training loop takes from it after every step


def report(values: Mapping[str, Any] | None = None, /, **named: Any) -> None:
    """Report scalars for the current step: ``report({"accuracy": 0.9})`` or ``report(accuracy=0.9)``."""
    if values is not None:
        COLLECTOR.report(values)
    if named:
        COLLECTOR.report(named)
