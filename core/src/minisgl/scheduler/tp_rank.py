"""A tensor-parallel rank's process, started by rank 0's node with its launch arguments as JSON on stdin."""

from .tp import follower_main

if __name__ == "__main__":
    follower_main()
