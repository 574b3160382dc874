"""Model and data factories of the train-loop tests (``"tests.workers.checkpoint.job_parts:..."``).

``tiny_gpt()``: a one-block GPT over a 32-token vocabulary.
``flaky_data(fail_after=N, marker=path)``: the restart test's fault -- the dataset raises on
its N+1-th item in this process unless ``marker`` exists, and creates ``marker`` as it fails,
so the restarted run trains through. Items are the synthetic Markov chain's samples.
``dies_after_commit(after=N, manifest=path)``: a lost node -- on its N+1-th item the process
waits until ``path`` (a checkpoint's manifest) exists, then kills itself with SIGKILL: no
``finally``, no last flush of anything it buffered.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from workers.data import SyntheticDataset
from workers.models import GPT, preset_config


def tiny_gpt():
    return GPT(preset_config("gpt-nano", vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))


class FailsOnce:
    def __init__(self, vocab_size: int, seq_len: int, fail_after: int | None, marker: str | None):
        self.samples = SyntheticDataset(vocab_size, seq_len)
        self.fail_after, self.marker, self.calls = fail_after, marker, 0

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after and not Path(self.marker).exists():
            Path(self.marker).touch()
            raise RuntimeError("injected worker failure")
        return self.samples.sample(index)


def flaky_data(vocab_size: int = 32, seq_len: int = 8, fail_after: int | None = None, marker: str | None = None):
    return FailsOnce(vocab_size, seq_len, fail_after, marker)


class DiesAfterCommit(FailsOnce):
    def __init__(self, vocab_size: int, seq_len: int, after: int, manifest: str):
        super().__init__(vocab_size, seq_len, None, None)
        self.after, self.manifest = after, Path(manifest)

    def __getitem__(self, index: int):
        self.calls += 1
        if self.calls > self.after:
            deadline = time.monotonic() + 60
            while not self.manifest.exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # the commit happens in another thread of this process
            os.kill(os.getpid(), signal.SIGKILL)
        return self.samples.sample(index)


def dies_after_commit(vocab_size: int = 32, seq_len: int = 8, *, after: int, manifest: str):
    return DiesAfterCommit(vocab_size, seq_len, after, manifest)
