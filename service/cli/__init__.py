"""The ``zerotrain`` command (console script ``zerotrain = "service.cli:main"``)."""

from service.cli.main import CliError, main

__all__ = ["CliError", "main"]
