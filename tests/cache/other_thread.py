"""Running a computation in another thread with its own stream, as the demo runs its two
generations: a constant a compiled function or a cached mask holds must not belong to the
stream of the thread that first built it."""

import threading

import mlx.core as mx


def failures_in_another_threads_stream(build) -> list:
    """Evaluates build() in a new thread inside a new CPU stream; the exceptions it raised (a
    thread's exception would otherwise only be a warning)."""
    failures = []

    def run():
        try:
            with mx.stream(mx.new_stream(mx.cpu)):
                mx.eval(build())
        except Exception as error:
            failures.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return failures
