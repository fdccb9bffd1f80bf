"""`python -m l4m.spawner`: see l4m.spawner.cli."""

from l4m.spawner.cli import main

if __name__ == "__main__":
    main()
