"""A click option whose error messages name where its bad value came from."""

from __future__ import annotations

import os

import click
from click.core import ParameterSource


class SourceOption(click.Option):
    """An option that blames the flag, the environment variable or the config key actually
    used (click names the variable even when the user typed the flag)."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        """'--flag', environment variable 'VLAUNCH_X' or config key 'x': what gave the value."""
        source = ctx.get_parameter_source(self.name) if ctx and self.name else None
        if source is ParameterSource.ENVIRONMENT and self.envvar:
            names = [self.envvar] if isinstance(self.envvar, str) else list(self.envvar)
            used = next((n for n in names if n in os.environ), names[0])
            return f"environment variable '{used}'"
        if source is ParameterSource.DEFAULT_MAP and self.opts:
            return f"config key '{self.opts[0].lstrip('-')}'"
        return " / ".join(f"'{x}'" for x in (self.opts or [self.human_readable_name]))
