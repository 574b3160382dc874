"""The command's two consoles: results go to stdout (``out``), messages to stderr (``err``).

Both are created once and shared by every command group so that what a command prints and
how a mistake is reported look the same everywhere (and pytest's ``capsys`` sees both: a
rich ``Console`` without a file writes to whatever ``sys.stdout``/``sys.stderr`` is now).
"""

from __future__ import annotations

from rich.console import Console

out = Console()
err = Console(stderr=True)
