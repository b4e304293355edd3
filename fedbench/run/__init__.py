"""One run from a composed config: its setup (build_setup) and, later, its record schema."""
