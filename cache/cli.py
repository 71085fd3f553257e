"""The cache rank's command line (also `vlaunch cache`)."""

from __future__ import annotations

import sys

import click


@click.command("cache", context_settings={"auto_envvar_prefix": "VLAUNCH",
                                          "show_default": True})
@click.option("--model", required=True, help="Checkpoint: a .safetensors file or a directory.")
@click.option("--rank", default=0, type=click.IntRange(0), help="Global rank of this cache.")
@click.option("--tensor-parallel-size", "tp", default=1, type=click.IntRange(1))
@click.option("--pipeline-parallel-size", "pp", default=1, type=click.IntRange(1))
@click.option("--data-parallel-size", "dp", default=1, type=click.IntRange(1))
@click.option("--device", default="cpu", help="cpu, cuda or cuda:N.")
@click.option("--socket-dir", default="", help="Directory of the rank sockets (0700).")
@click.option("--plan", default="llama", help="Shard plan: builtin name, plan file or module:fn.")
@click.option("--threads", default=8, type=click.IntRange(1), help="Reader threads.")
@click.option("--checksum/--no-checksum", default=None,
              help="crc32 per tensor in the manifest [default: on for cpu, off for cuda].")
@click.option("--kernel-backends", default="", help="Fingerprint field set by integrations.")
@click.option("--loader", default="vlaunch", help="Loader identity (fingerprint field).")
@click.option("--ready-fd", default=-1, type=int, help="Unix socket fd to report ready on.")
@click.option("--adopt-fd", default=-1, type=int, help="Unix socket fd carrying escrowed slabs.")
def cache_command(model: str, rank: int, tp: int, pp: int, dp: int, device: str,
                  socket_dir: str, plan: str, threads: int, checksum: bool | None,
                  kernel_backends: str, loader: str, ready_fd: int, adopt_fd: int) -> None:
    """Run one cache rank: load its shard, then serve it on its socket until SIGTERM."""
    from .errors import UsageError
    from .plan import Layout
    from .rank import RankOptions, main

    try:
        layout = Layout.from_global(rank, tp, pp, dp)
    except UsageError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(int(exc.status))
    sys.exit(main(RankOptions(model=model, layout=layout, device=device, socket_dir=socket_dir,
                              plan=plan, threads=threads, checksum=checksum,
                              kernel_backends=kernel_backends, loader=loader,
                              ready_fd=ready_fd, adopt_fd=adopt_fd)))
