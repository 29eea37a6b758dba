"""The ``krypton`` command: ``main`` parses and dispatches (:mod:`.main`); ``compare``,
``pacs`` and ``volumes`` hold the subcommands and options of their own kind."""

from .main import build_parser, explain_options, main, main_entry

__all__ = ["build_parser", "explain_options", "main", "main_entry"]
