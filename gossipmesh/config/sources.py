"""Where a config's values come from: defaults < TOML file < ``GOSSIPMESH_*`` environment < flags.

Every source is read through the option declarations (``gossipmesh.config.options``): the flags
of a command's parser are made from its config class's fields, and each value, whichever source
it came from, is parsed once into its typed value, with errors that name the source
(``--lr``, ``GOSSIPMESH_LR``, ``node.toml: lr``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gossipmesh.config.configs import ConfigError, NodeConfig, Options, TrainConfig
from gossipmesh.config.options import Option, flag, option_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "GOSSIPMESH_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
CONFIG_FLAG = "config"

Config = TypeVar("Config", bound=Options)


def add_options(parser: argparse.ArgumentParser, config: type[Options], *, files: bool) -> None:
    """Arguments for every option of ``config``, grouped by the class that declares them (only
    those given end up in the namespace); with ``files``, ``--config FILE.toml`` too."""
    if files:
        parser.add_argument(
            flag(CONFIG_FLAG),
            type=Path,
            metavar="FILE.toml",
            help=f"read options from a TOML file (or ${CONFIG_ENV})",
        )
    fields = dataclasses.fields(config)
    owners = {field.name: _declared_by(config, field.name) for field in fields}
    groups = {  # the command's own options first, then those of the groups it builds on
        owner: parser.add_argument_group(f"{owner.title} options")
        for owner in config.__mro__
        if issubclass(owner, Options) and owner in owners.values()
    }
    for field in fields:
        _add(groups[owners[field.name]], field.name, option_of(field), field.default)


def _add(parser: argparse._ArgumentGroup, name: str, option: Option, default: Any) -> None:
    absent = default is None or default is False or default == () or default is dataclasses.MISSING
    shown = None if absent else option.text(default)
    help = option.help_text + (f" (default: {shown})" if shown is not None else "")
    metavar = option.metavar or name.upper()
    if option.form == "positional":
        nargs = None if option.required else "?"
        parser.add_argument(name, nargs=nargs, metavar=metavar, help=help, default=argparse.SUPPRESS)
    elif option.form == "switch":
        parser.add_argument(
            flag(name), dest=name, action="store_const", const=True, help=help, default=argparse.SUPPRESS
        )
    else:
        action = "append" if option.form == "list" else "store"
        parser.add_argument(
            flag(name), dest=name, action=action, metavar=metavar, help=help, default=argparse.SUPPRESS
        )


def _declared_by(config: type[Options], name: str) -> type[Options]:
    """The class of ``config``'s hierarchy that declares field ``name`` (its group in --help)."""
    return next(base for base in reversed(config.__mro__) if name in inspect.get_annotations(base))


def load(
    config: type[Config],
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Config:
    """``config`` from defaults < ``config_file`` < ``env`` < ``flags`` (each value parsed);
    ConfigError naming the option for a bad value or combination."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    values: dict[str, Any] = {}
    if config_file is not None:
        for key, value in _read_toml(config_file).items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"{config_file}: unknown option {key!r}; known: {', '.join(fields)}")
            values[name] = _read(option_of(fields[name]), value, f"{config_file}: {key}")
    _check_env_names(env or {}, fields)
    for name, field in fields.items():
        if (raw := (env or {}).get(ENV_PREFIX + name.upper())) is not None:
            values[name] = _read(option_of(field), raw, ENV_PREFIX + name.upper())
    for name, raw in flags.items():
        if name in fields:
            option = option_of(fields[name])
            values[name] = _read(option, raw, name if option.form == "positional" else flag(name))
    return config(**values)


def _check_env_names(env: Mapping[str, str], fields: Mapping[str, dataclasses.Field[Any]]) -> None:
    """ConfigError for a ``GOSSIPMESH_*`` variable that names no option of any command (a typo
    would otherwise be ignored); one of another command's options passes (a mesh's nodes
    inherit its environment)."""
    known = {CONFIG_ENV} | {ENV_PREFIX + name.upper() for name in _every_option_name()}
    for variable in sorted(v for v in env if v.startswith(ENV_PREFIX) and v not in known):
        ours = [name.upper() for name in fields] + [CONFIG_ENV.removeprefix(ENV_PREFIX)]
        closest = difflib.get_close_matches(variable.removeprefix(ENV_PREFIX), ours, n=1)
        hint = (
            f"did you mean {ENV_PREFIX}{closest[0]}?" if closest else f"an option's is {ENV_PREFIX}<OPTION>"
        )
        raise ConfigError(f"{variable}: no such option ({hint}); fix or unset it")


def _every_option_name() -> set[str]:
    """The fields of every command's config (and of the groups they are made of)."""
    names: set[str] = set()
    pending: list[type[Options]] = [Options]
    while pending:
        config = pending.pop()
        names.update(f.name for f in dataclasses.fields(config))
        pending.extend(config.__subclasses__())
    return names


def from_namespace(config: type[Config], args: argparse.Namespace, env: Mapping[str, str] | None) -> Config:
    """The config of a parsed command line; the TOML file is ``--config``, else
    ``GOSSIPMESH_CONFIG`` (a file mounted into a container). ``env`` None: no env, no file."""
    flags = {k: v for k, v in vars(args).items() if k not in ("command", CONFIG_FLAG)}
    config_file = getattr(args, CONFIG_FLAG, None)
    if config_file is None and env is not None and env.get(CONFIG_ENV):
        config_file = Path(env[CONFIG_ENV])
    return load(config, flags, env, config_file)


def node_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> NodeConfig:
    """A node's config as ``gossipmesh node`` reads it (flags, default ``sys.argv[1:]``, over
    ``GOSSIPMESH_*`` over ``--config``), for a user's own training script; a bad value exits
    with status 2 and the option to fix, as the daemon does."""
    parser = argparse.ArgumentParser(description="A gossipmesh node (options as for gossipmesh node).")
    add_options(parser, NodeConfig, files=True)
    try:
        return from_namespace(NodeConfig, parser.parse_args(argv), os.environ if env is None else env)
    except ConfigError as exc:
        parser.error(str(exc))


def as_flags(config: TrainConfig) -> list[str]:
    """The training options of ``config`` as node flags (what a mesh forwards to its nodes)."""
    argv: list[str] = []
    for field in dataclasses.fields(TrainConfig):
        option, value = option_of(field), getattr(config, field.name)
        if option.form == "switch":
            argv += [flag(field.name)] if value else []
            continue
        for item in value if option.form == "list" else [value]:
            text = option.text(item)
            argv += [flag(field.name), text] if text is not None else []
    return argv


def summary(config: Options) -> dict[str, Any]:
    """The config as JSON-ready values (for the run report), with the topology resolved."""
    values = {f.name: _json(option_of(f), getattr(config, f.name)) for f in dataclasses.fields(config)}
    graph = getattr(config, "graph", None)
    return {**values, "topology": str(graph)} if graph is not None else values


def _json(option: Option, value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or (value is None and option.none is None):
        return value
    if isinstance(value, tuple):
        return [option.text(item) for item in value]
    return option.text(value)


def _read(option: Option, value: Any, source: str) -> Any:
    """The typed value of a raw one: flag or env text, a repeated flag's list, a TOML value."""
    try:
        if option.form == "list":
            items = value if isinstance(value, list | tuple) else [value]
            parts = (part.strip() for item in items for part in _text(item).split(","))
            return tuple(option.read(part) for part in parts if part)
        if option.form == "switch" and isinstance(value, bool):
            return value
        return option.read(_text(value))
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _text(value: Any) -> str:
    """A TOML scalar as the text a flag would carry (a table, list or bool where a single value
    is expected is refused)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"expected a single value, got {value!r}")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as stream:
            return tomllib.load(stream)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
