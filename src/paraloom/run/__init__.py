"""Launching a run: the launcher (torch's elastic agent on this machine), the worker entry point
(`python -m paraloom.run.worker` under torchrun), the checks before launch (preflight, batch_check,
prestart) and the run directories."""
