"""A second recipe: an MLP classifier on interleaved spirals generated in code (label noise,
so validation accuracy plateaus and early stopping by patience ends the run)."""
