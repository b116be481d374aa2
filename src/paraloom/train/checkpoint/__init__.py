"""Checkpoints, one component the loop holds: the DCP store (store.py: atomic, checksummed,
keep-last-k), a state's tensors apart from its skeleton (state_tree.py), the records of each resume
and resize (records.py) and run.resize_policy (resize_policy.py)."""
