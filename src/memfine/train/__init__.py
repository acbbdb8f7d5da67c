"""memfine.train."""
