"""Any objective by name, a user's own by import path, through the post-training assembly."""
