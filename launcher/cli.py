"""The `vlaunch` command line."""

from __future__ import annotations

import json
import sys

import click

from vlaunch.cache.exitcodes import EXIT_TABLE, ExitStatus


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="vlaunch")
def cli() -> None:
    """Keep LLM weights resident across inference-engine restarts."""


@cli.command("exit-codes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def exit_codes(as_json: bool) -> None:
    """Print the exit-status table of vlaunch processes."""
    if as_json:
        click.echo(json.dumps([{"status": int(i.status), "name": i.status.name, "who": i.who,
                                "meaning": i.meaning, "retry": i.retry} for i in EXIT_TABLE],
                              indent=2))
        return
    for info in EXIT_TABLE:
        click.echo(f"{int(info.status):>3}  {info.status.name:<18} {info.meaning}")


def _add_cache_command() -> None:
    from vlaunch.cache.cli import cache_command

    cli.add_command(cache_command)


_add_cache_command()


def main() -> None:
    """Console-script entry point: usage errors exit with the documented usage status."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.UsageError as exc:
        exc.show()
        sys.exit(int(ExitStatus.USAGE))
    except click.ClickException as exc:
        exc.show()
        sys.exit(int(ExitStatus.USAGE))
