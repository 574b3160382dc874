"""Reading what a ``zerotrain`` command printed as a table."""

from __future__ import annotations

import re


def table_rows(printed: str) -> list[list[str]]:
    """The cells of each row of a table the command printed (rich's box lines left out), header first."""
    return [[cell.strip() for cell in re.split("[│┃]", line)[1:-1]] for line in printed.splitlines()
            if line.startswith(("│", "┃"))]
