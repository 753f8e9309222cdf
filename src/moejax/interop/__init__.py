"""Reading and writing other frameworks' checkpoints."""
