"""memfine.parallel."""
