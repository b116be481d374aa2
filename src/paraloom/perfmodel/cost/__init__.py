"""Pure cost formulas, torch-free: `step_time.estimate` prices a plan from the terms the other
modules give (network, memory, overlap, compression, device and CPU costs, links, the parameter
server's sync, storage)."""
