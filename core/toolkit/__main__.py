"""``python -m toolkit`` runs the CLI (also how torchrun launches it)."""

from toolkit.cli import main

if __name__ == "__main__":
    main()
