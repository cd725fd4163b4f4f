"""Every command's flags also from the environment: `--log-level` of `holdback gateway` is
HOLDBACK_GATEWAY_LOG_LEVEL. Applied once where each command builds its argparse parser; a flag on
the command line wins. Standard library only, so the gateway and simulator stay light.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Mapping


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def flag_env_name(component: str, flag: str) -> str:
    """`("gateway", "--log-level")` -> `HOLDBACK_GATEWAY_LOG_LEVEL`."""
    return f"HOLDBACK_{component.upper()}_{flag.lstrip('-').upper().replace('-', '_')}"


def flags_from_env(parser: argparse.ArgumentParser, component: str,
                   environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Default every long flag of `parser` to its HOLDBACK_<COMPONENT>_<FLAG> variable when that is set.

    A flag on the command line still wins. Values are converted and checked as the flag's own would be,
    so a bad variable fails at start-up naming the variable. Returns the parser for `return flags_from_env(p, ...)`.
    """
    environ = os.environ if environ is None else environ
    names = []
    for action in parser._actions:  # argparse has no public iterator over its actions
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags or action.dest in (argparse.SUPPRESS, "help", "version"):
            continue
        name = flag_env_name(component, flags[0])
        names.append(name)
        if name not in environ:
            continue
        action.default = _env_value(parser, action, name, environ[name])
        action.required = False
    if names:
        note = f"Every --flag can also be set as HOLDBACK_{component.upper()}_<FLAG>, e.g. {names[0]}; " \
               "a flag given on the command line wins."
        parser.epilog = f"{parser.epilog}\n\n{note}" if parser.epilog else note
    return parser


def _env_value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> object:
    if action.nargs == 0:  # store_true / store_false / store_const
        text = raw.strip().lower()
        if text not in _TRUE | _FALSE:
            parser.error(f"{name}={raw!r}: use one of 1/0, true/false, yes/no, on/off")
        on = text in _TRUE
        return action.const if on else (not action.const if isinstance(action.const, bool) else None)
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+")
    values = [_convert(parser, action, name, v) for v in (shlex.split(raw) if many else [raw])]
    return values if many else values[0]


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> object:
    try:
        value = action.type(raw) if callable(action.type) else raw
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{name}={raw!r} is not valid for {action.option_strings[-1]}: {exc}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{name}={raw!r}: choose one of {', '.join(map(str, action.choices))}")
    return value
