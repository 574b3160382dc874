"""``SwapFolder``: ranks that open and remove their folders at the same time under one
``nvme_path`` that a rank made leave nothing behind once the last of them is removed, and a
``nvme_path`` the user made stays.

A rank reopens its folder (a resumed engine, the next attempt) while another closes its own:
were the check "does ``nvme_path`` exist" and the ``mkdir`` of the rank's folder apart, the
closing rank could remove ``nvme_path`` in between and the reopening one make it again without
its marker -- a folder no rank would ever remove.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from workers.zero.swap_io import SwapFolder

RANKS, ROUNDS = 4, 150


def _churn(root: str, rank: int, start) -> None:
    start.wait()
    for _ in range(ROUNDS):
        folder = SwapFolder(root, rank)
        (folder.path / "x.swap").write_bytes(b"\0")
        folder.remove()


def _run(root: Path) -> None:
    context = mp.get_context("fork")
    start = context.Barrier(RANKS)
    ranks = [context.Process(target=_churn, args=(str(root), rank, start)) for rank in range(RANKS)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    assert [process.exitcode for process in ranks] == [0] * RANKS


def test_ranks_opening_and_closing_at_once_leave_no_nvme_path_they_made(tmp_path):
    root = tmp_path / "swap"
    _run(root)
    assert not root.exists(), sorted(p.name for p in root.iterdir())


def test_an_nvme_path_the_user_made_stays_and_is_left_empty(tmp_path):
    root = tmp_path / "swap"
    root.mkdir()
    _run(root)
    assert root.exists() and not any(root.iterdir())
