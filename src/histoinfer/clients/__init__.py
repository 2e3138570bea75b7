"""Client backends. ``inprocess`` needs torch; ``http`` only httpx (each imported lazily)."""
