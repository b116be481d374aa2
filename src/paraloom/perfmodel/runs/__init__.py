"""A run's own bookkeeping against the model: the runtime contract (predicted against measured),
the history of runs, finished runs read back, and what is fitted from them."""
