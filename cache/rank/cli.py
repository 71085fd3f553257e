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
@click.option("--artifact-dir", default="",
              help="Directory (a volume) where artifacts persist across restarts.")
@click.option("--seed", default="",
              help="Fill from a running replica: unix:/source/socket-dir or tcp://HOST:BASE.")
@click.option("--seed-token", default="", show_default=False,
              help="Shared secret for seeding over TCP (both sides; prefer the env var).")
@click.option("--seed-fallback", is_flag=True, default=False,
              help="A failed seed loads from disk with a warning instead of exiting 76.")
@click.option("--seed-listen-host", default="127.0.0.1", help="Address the seed source binds.")
@click.option("--seed-listen-port", default=0, type=click.IntRange(0, 65535),
              help="Serve seeding over TCP on this port + rank (needs --seed-token; 0: off).")
@click.option("--seed-timeout", default=30.0, type=click.FloatRange(0.1),
              help="Seconds any one seeding read or write may wait.")
def cache_command(model: str, rank: int, tp: int, pp: int, dp: int, device: str,
                  socket_dir: str, plan: str, threads: int, checksum: bool | None,
                  kernel_backends: str, loader: str, ready_fd: int, adopt_fd: int,
                  artifact_dir: str, seed: str, seed_token: str, seed_fallback: bool,
                  seed_listen_host: str, seed_listen_port: int, seed_timeout: float) -> None:
    """Run one cache rank: load its shard, then serve it on its socket until SIGTERM."""
    from vlaunch.cache.contract.errors import UsageError
    from vlaunch.cache.rank.process import RankOptions, main
    from vlaunch.cache.store.plan import Layout

    try:
        layout = Layout.from_global(rank, tp, pp, dp)
    except UsageError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(int(exc.status))
    sys.exit(main(RankOptions(model=model, layout=layout, device=device, socket_dir=socket_dir,
                              plan=plan, threads=threads, checksum=checksum,
                              kernel_backends=kernel_backends, loader=loader,
                              ready_fd=ready_fd, adopt_fd=adopt_fd, artifact_dir=artifact_dir,
                              seed=seed, seed_token=seed_token, seed_fallback=seed_fallback,
                              seed_listen_host=seed_listen_host,
                              seed_listen_port=seed_listen_port, seed_timeout=seed_timeout)))
