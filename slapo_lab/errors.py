"""The one exception type that every schedule primitive raises on bad input."""


class ScheduleError(ValueError):
    """A primitive could not be applied; ``str(err)`` is one clear sentence.

    Raised before any mutation, so the schedule and its record are unchanged.
    """
