"""Using a trained workflow: answering new inputs from Python, the CLI and an HTTP server."""

__all__ = ["Answer", "TrainedWorkflow", "load_workflow"]


def __getattr__(name: str):
    """The workflow's names, imported on first use: the CLI reads :mod:`marlow.serving.limits`
    without loading torch."""
    if name in __all__:
        from marlow.serving import trained

        return getattr(trained, name)
    raise AttributeError(f"module 'marlow.serving' has no attribute {name!r}")
