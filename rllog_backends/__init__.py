"""Built-in rllog backends, one file each. Each imports its tracker lazily, inside the sink."""
