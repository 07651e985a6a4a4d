"""A clock that moves only when a test says so: code under test takes ``clock=`` and needs no sleeps."""


class ManualClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
