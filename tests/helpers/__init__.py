"""Helpers that tests import as modules (a conftest is pytest's to load, never imported by name)."""
