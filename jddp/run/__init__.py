"""Running an experiment config: its keys and checks, the objects it builds, resume, and the command
line."""
