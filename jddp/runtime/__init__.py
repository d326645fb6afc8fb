"""The processes a run lives in: multi-process setup, the launcher and its supervisor, the hang
watchdog, preemption, host memory, files and quiet logs."""
