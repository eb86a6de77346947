"""The ``gossipmesh`` command line: every command's parser made from its config class."""

from gossipmesh.cli.main import COMMANDS, build_parser, main, parse_config

__all__ = ["COMMANDS", "build_parser", "main", "parse_config"]
