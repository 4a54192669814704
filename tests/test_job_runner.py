"""tests/job_runner.py's MainJob reports a job's exit code as `subprocess.Popen` does, also for a rank that ends while
it is being polled."""

from __future__ import annotations

from tests.job_runner import MainJob


class _EndsWhenFirstRead:
    """A rank that is still running at the first reading of its exit code and has exited 1 at every later one: the
    race a real process wins only now and then (CI35: a job that printed its error and exited 1 came back as 0),
    here at every poll. A stand-in, since the timing of a real exit cannot be chosen."""

    def __init__(self) -> None:
        self.reads = 0

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return None if self.reads == 1 else 1

    def join(self) -> None:
        pass


def test_a_rank_that_exits_during_a_poll_is_not_taken_for_a_success() -> None:
    job = MainJob.__new__(MainJob)  # its ranks only: nothing is forked
    job.ranks, job.returncode = [_EndsWhenFirstRead()], None
    codes = [job.poll() for _ in range(2)]
    assert codes == [None, 1]
