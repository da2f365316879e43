"""The default recipe: a byte-level GPT trained on the Python standard library's .py files."""
