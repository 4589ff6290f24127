"""Using a trained workflow: answering new inputs from Python, the CLI and an HTTP server."""

from marlow.serving.workflow import Answer, TrainedWorkflow, load_workflow

__all__ = ["Answer", "TrainedWorkflow", "load_workflow"]
