"""Task queue names. Workflows and I/O-bound activities share RAGLINE_TASK_QUEUE; CPU-bound
activities (`queue = "cpu"` in the policy file) run on its `-cpu` companion, whose worker takes
only a few at a time."""


def cpu_queue(task_queue: str) -> str:
    return f"{task_queue}-cpu"
