"""The shared core every technique builds on: efficiency accounting and FLOPs, deterministic seeds, argument checks,
resume handling, the index transport and the loader-owning DataModule wrapper. See ``docs/architecture.md``."""
