"""vlaunch.launcher: the `vlaunch` command and the supervisor. Never imports torch."""
