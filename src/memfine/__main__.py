"""``python -m memfine`` runs the CLI."""

from memfine.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
