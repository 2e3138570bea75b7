"""Client backends. ``inprocess`` needs torch; ``http`` needs only httpx (imported lazily)."""
