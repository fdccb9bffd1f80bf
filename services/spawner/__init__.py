"""The spawner: sandboxed controllers, their runtime and their lifecycle."""
