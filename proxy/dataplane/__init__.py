"""One request's way through: relay, generation, holds and continuations."""
