"""The ``zerotrain`` command (console script ``zerotrain = "service.cli:main"``); see ``main.py``."""

from service.cli.main import main

__all__ = ["main"]
