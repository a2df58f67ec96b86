"""`python -m batchd` is the `batchd` command."""
from batchd.cli.main import main

if __name__ == "__main__":
    main()
