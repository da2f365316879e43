"""A run's life on its processes: the output directory, devices, signals, one rank's
failure on every rank. Imports only errors, run_dir, checkpoint/ and gangs."""
