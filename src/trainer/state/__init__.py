"""The run's state components, each with `state_dict`/`load_state_dict`: counters and
scores, data position, RNG. Imports only errors, lifecycle/, checkpoint/, units, gangs."""
