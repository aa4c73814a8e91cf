"""Target hidden-state cache: the shard format, the writer (stage) and the reader."""
