"""The live frontier and the continuation decision procedure (lands with the engine issue)."""
