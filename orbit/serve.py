"""The documented `python -m orbit.serve [daphne's arguments]`: server.serve."""

from server.serve import main

if __name__ == "__main__":
    main()
