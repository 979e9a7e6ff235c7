"""Task queue names. One queue today; named here so a deployment can split CPU-heavy embedding
onto its own workers without touching workflow code."""

from ragline.settings import get_settings


def default_queue() -> str:
    return get_settings().task_queue
