"""Jobs: specs, placement, gang reservation, executing ranks, and their records."""
