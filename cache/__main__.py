"""`python -m vlaunch.cache`: run one cache rank (the launcher spawns this; users may too)."""

from vlaunch.cache.rank.cli import cache_command

if __name__ == "__main__":
    cache_command(prog_name="python -m vlaunch.cache")
